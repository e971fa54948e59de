"""Who may use the console, and proof that a POST comes from its own pages.

:func:`basic_auth` checks HTTP Basic credentials against ``ONCELY_WEB_USER`` /
``ONCELY_WEB_PASSWORD`` in constant time. A service mounting the console passes its own
dependency instead (any callable FastAPI can resolve that returns the operator's name).

Every POST must come from the console's own origin (its ``Origin`` header, or failing that its
``Referer``, names the request's own scheme and host) and carry the CSRF token of its form: an
HMAC of the operator's name under a key made when the console starts. Browsers send Basic
credentials with cross-site requests too, so authentication alone would not stop a page
elsewhere from posting a requeue.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Callable
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, status
from fastapi.security import HTTPBasicCredentials

from oncely.settings import WebSettings

Authenticate = Callable[..., str]
"""A FastAPI dependency that returns the operator's name, or raises ``HTTPException``."""

NO_AUTH_OPERATOR = "local"
"""The operator's name when the console runs ``--no-auth`` on localhost."""


def basic_auth(settings: WebSettings) -> Authenticate:
    """A dependency accepting the Basic credentials of ``settings`` (both must be set)."""
    if settings.user is None or settings.password is None:
        raise ValueError("basic_auth needs ONCELY_WEB_USER and ONCELY_WEB_PASSWORD")
    user = settings.user.encode()
    password = settings.password.get_secret_value().encode()

    def authenticate(request: Request) -> str:
        credentials: HTTPBasicCredentials | None = None
        header = request.headers.get("authorization", "")
        if header.lower().startswith("basic "):
            credentials = _credentials(header)
        given_user = credentials.username.encode() if credentials else b""
        given_password = credentials.password.encode() if credentials else b""
        # Both compared every time, so the time taken says nothing about which one differed.
        user_ok = hmac.compare_digest(given_user, user)
        password_ok = hmac.compare_digest(given_password, password)
        if not (credentials and user_ok and password_ok):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="give the console's user and password (ONCELY_WEB_USER)",
                headers={"WWW-Authenticate": 'Basic realm="oncely"'},
            )
        return credentials.username

    return authenticate


def _credentials(header: str) -> HTTPBasicCredentials | None:
    try:
        decoded = base64.b64decode(header[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    username, separator, password = decoded.partition(":")
    return HTTPBasicCredentials(username=username, password=password) if separator else None


def no_auth() -> str:
    """The dependency of a console started ``--no-auth`` on localhost."""
    return NO_AUTH_OPERATOR


class Csrf:
    """Issues and checks the token a console's forms carry (see the module)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def token(self, operator: str) -> str:
        """The token of ``operator``'s forms."""
        return hmac.new(self._key, operator.encode(), hashlib.sha256).hexdigest()

    def check(self, request: Request, operator: str, token: str) -> None:
        """Raise 403 unless ``request`` comes from the console's origin with ``operator``'s
        token."""
        if not same_origin(request):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                detail="refused: a POST from another origin (use the console's own pages)",
            )
        if not hmac.compare_digest(token, self.token(operator)):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                detail="refused: the form's CSRF token is missing or wrong (reload the page)",
            )


def same_origin(request: Request) -> bool:
    """Whether ``Origin`` (or, without it, ``Referer``) names the request's scheme and host."""
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source or source == "null":
        return False
    given = urlsplit(source)
    return (given.scheme, given.netloc) == (request.url.scheme, request.url.netloc)
