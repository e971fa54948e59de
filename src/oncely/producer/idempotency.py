"""Inbound idempotency keys: recognise a retried request and hand back its first outcome.

One row per ``(owner, key)`` in ``oncely_idempotency_keys``. The owner is whoever picks the
keys: a webhook, or the *user* behind an API key (so rotating the key still recognises the same
request). The rules, applied by :meth:`IdempotencyKeys.claim`, by the existing row:

- none (the insert wins): ``Claim(previous=None, reclaimed=False)``: process it;
- ``accepted``: ``Claim(previous={..., "duplicate": True})``: do not process it;
- ``rejected``: claimed again (a rejected request may be resent);
- ``processing``, older than the stale limit: ``Claim(previous=None, reclaimed=True)``: the
  first worker most likely died; look for work already done;
- ``processing``, fresh: :class:`IdempotencyBusyError` (HTTP 409);
- vanished between conflict and read: :class:`IdempotencyBusyError`;
- a different fingerprint, accepted or processing: :class:`IdempotencyMismatchError` (HTTP
  422): never hand back another request's result.

Re-claiming is a conditional UPDATE (status and ``received_at`` must still match), so of two
concurrent re-claims exactly one wins and the other gets :class:`IdempotencyBusyError`.
Staleness is measured on the database clock. Each call runs in its own short transaction, so a
claim is visible to concurrent requests at once.

The rules are written once, as generators of statements (:func:`_claim_steps`), driven by a
sync (:class:`IdempotencyKeys`) and an async (:class:`AsyncIdempotencyKeys`) runner.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from oncely.errors import OncelyError
from oncely.runtime.steps import Sql, Step, drive, drive_async
from oncely.storage.queries import query
from oncely.storage.tables import IDEMPOTENCY_KEY_MAX

STALE_AFTER_SECONDS = 600.0

FinishStatus = Literal["accepted", "rejected"]
R = TypeVar("R")
_Steps = Generator[Step, "list[sa.Row[Any]]", R]


class IdempotencyError(OncelyError):
    """An idempotency key could not be claimed or finished."""


class IdempotencyBusyError(IdempotencyError):
    """A request with this idempotency key is being processed; retry later (HTTP 409)."""

    http_status = 409


class IdempotencyMismatchError(IdempotencyError):
    """This idempotency key was used for a different request (HTTP 422)."""

    http_status = 422


class InvalidIdempotencyKeyError(IdempotencyError):
    """The idempotency key is empty or longer than 200 characters (HTTP 400)."""

    http_status = 400


class ClaimLostError(IdempotencyError):
    """The claim is no longer processing: it was finished or taken over by another request."""


@dataclass(frozen=True)
class Claim:
    """The result of :meth:`IdempotencyKeys.claim`.

    ``previous`` is set only for a duplicate of an accepted request: ``{"status": "accepted",
    "detail": ..., "result": ..., "duplicate": True}``; return it instead of processing.
    ``reclaimed`` is true when a stale ``processing`` claim was taken over: look for work
    already done under this key before doing it again.
    """

    previous: dict[str, Any] | None
    reclaimed: bool

    @property
    def duplicate(self) -> bool:
        return self.previous is not None


def _check_key(key: str) -> None:
    if not key or len(key) > IDEMPOTENCY_KEY_MAX:
        raise InvalidIdempotencyKeyError(
            f"idempotency key of {len(key)} characters: use 1 to {IDEMPOTENCY_KEY_MAX} characters"
        )


def _json(value: Mapping[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, default=str)


def _claim_steps(
    owner: str,
    key: str,
    fingerprint: str | None,
    extra: Mapping[str, Any] | None,
    stale_after: float,
) -> _Steps[Claim]:
    _check_key(key)
    ident = {"owner": owner, "key": key}
    inserted = yield Sql(
        query("idempotency_insert"),
        {**ident, "fingerprint": fingerprint, "extra": _json(extra)},
    )
    if inserted:
        return Claim(previous=None, reclaimed=False)
    rows = yield Sql(query("idempotency_get"), ident)
    if not rows:
        raise IdempotencyBusyError(f"idempotency key {key!r} changed while being read; retry")
    existing = rows[0]._mapping
    status = existing["status"]
    if (
        status in ("accepted", "processing")
        and fingerprint is not None
        and existing["fingerprint"] is not None
        and fingerprint != existing["fingerprint"]
    ):
        raise IdempotencyMismatchError(
            f"idempotency key {key!r} was already used for a different request"
        )
    if status == "accepted":
        previous = {
            "status": "accepted",
            "detail": existing["detail"],
            "result": existing["result"],
            "duplicate": True,
        }
        return Claim(previous=previous, reclaimed=False)
    stale = status == "processing" and float(existing["age_seconds"]) >= stale_after
    if status == "processing" and not stale:
        raise IdempotencyBusyError(
            f"a request with idempotency key {key!r} is being processed; retry later"
        )
    updated = yield Sql(
        query("idempotency_reclaim"),
        {
            **ident,
            "fingerprint": fingerprint,
            "extra": _json(extra),
            "expected_status": status,
            "expected_received_at": existing["received_at"],
        },
    )
    if not updated:
        raise IdempotencyBusyError(
            f"another request re-claimed idempotency key {key!r} first; retry later"
        )
    return Claim(previous=None, reclaimed=stale)


def _finish_steps(
    owner: str,
    key: str,
    status: FinishStatus,
    detail: str | None,
    result: Mapping[str, Any] | None,
) -> _Steps[None]:
    if status not in ("accepted", "rejected"):
        raise ValueError(f"finish status must be 'accepted' or 'rejected', not {status!r}")
    finished = yield Sql(
        query("idempotency_finish"),
        {
            "owner": owner,
            "key": key,
            "status": status,
            "detail": detail,
            "result": _json(result),
        },
    )
    if not finished:
        raise ClaimLostError(f"idempotency key {key!r} of {owner!r} is not being processed")


class IdempotencyKeys:
    """Claim and finish inbound idempotency keys on a (sync) SQLAlchemy ``Engine``.

    Raises :class:`IdempotencyBusyError`, :class:`IdempotencyMismatchError`,
    :class:`InvalidIdempotencyKeyError` or :class:`ClaimLostError` (all
    :class:`IdempotencyError`) as the rules in this module's docstring say.
    """

    def __init__(self, engine: sa.Engine, *, stale_after: float = STALE_AFTER_SECONDS) -> None:
        self.engine = engine
        self.stale_after = stale_after

    def claim(
        self,
        owner: str,
        key: str,
        *,
        fingerprint: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Claim:
        """Claim ``(owner, key)`` for processing; see the module docstring for the rules."""
        return drive(self.engine, _claim_steps(owner, key, fingerprint, extra, self.stale_after))

    def finish(
        self,
        owner: str,
        key: str,
        status: FinishStatus,
        detail: str | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the outcome of a claim: ``accepted`` (with its result) or ``rejected``."""
        drive(self.engine, _finish_steps(owner, key, status, detail, result))


class AsyncIdempotencyKeys:
    """:class:`IdempotencyKeys` for an ``AsyncEngine``: the same rules, awaited."""

    def __init__(self, engine: AsyncEngine, *, stale_after: float = STALE_AFTER_SECONDS) -> None:
        self.engine = engine
        self.stale_after = stale_after

    async def claim(
        self,
        owner: str,
        key: str,
        *,
        fingerprint: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Claim:
        """Claim ``(owner, key)`` for processing; see the module docstring for the rules."""
        return await drive_async(
            self.engine, _claim_steps(owner, key, fingerprint, extra, self.stale_after)
        )

    async def finish(
        self,
        owner: str,
        key: str,
        status: FinishStatus,
        detail: str | None = None,
        result: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the outcome of a claim: ``accepted`` (with its result) or ``rejected``."""
        await drive_async(self.engine, _finish_steps(owner, key, status, detail, result))
