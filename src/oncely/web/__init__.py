"""``oncely web``: the operator's console (``pip install 'oncely[web]'``).

:class:`Console` holds what the console reads and acts on; ``Console.app(authenticate)`` is a
standalone ASGI app, ``Console.router(authenticate)`` the same pages for a FastAPI service to
mount under its own path and behind its own auth dependency; :func:`basic_auth` is the
dependency ``oncely web`` uses. See docs/how-to/console.md.
"""

from oncely.web.auth import Authenticate, basic_auth, no_auth
from oncely.web.console import Console

__all__ = ["Authenticate", "Console", "basic_auth", "no_auth"]
