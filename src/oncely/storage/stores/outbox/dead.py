"""Dead letters of the outbox, and delayed rows: list them, and ask the relay to requeue or
skip them.

A dead row parks its key: later rows of the same topic and key are held behind it. So does a
delayed row (``available_at`` ahead) until it is due. The relay holding the key's shard carries
out a request: ``requeue`` publishes the parked row now, then the held rows, in order (if a
dead row fails again it stays dead); ``skip`` publishes only the held rows and never the parked
one (its outbox row stays until purged, for audit). A delayed row is changed only when named by
its id: requeueing every row of a topic, or all, leaves delayed rows to their time. Once
retention dropped a parked row's partition, its columns come from its kept copy
(``oncely_relay_kept``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query


@dataclass(frozen=True)
class DeadRow:
    """A parked row: ``reason`` ``dead`` (with ``error``) or ``delayed`` (due at ``until``);
    ``held``: the rows held behind its key; ``request``: requeue or skip, not carried out yet;
    ``seq`` and ``type`` ``None`` once the row is purged; ``created_at``: when it was staged;
    a dead row's ``attempts`` and ``first_failed_at`` (its last failure parked it:
    ``parked_at``), ``None`` for rows parked by relays before migration 0013."""

    id: UUID
    seq: int | None
    topic: str
    aggregateid: str
    type: str | None
    error: str | None
    parked_at: datetime
    held: int
    request: str | None
    reason: str = "dead"
    until: datetime | None = None
    created_at: datetime | None = None
    attempts: int | None = None
    first_failed_at: datetime | None = None


@dataclass(frozen=True)
class ChangedRow:
    id: UUID
    topic: str
    aggregateid: str


def list_dead(
    engine: sa.Engine, *, topic: str | None = None, delayed: bool = False
) -> list[DeadRow]:
    """The dead rows (of ``topic``, when given), and with ``delayed`` the delayed ones too;
    oldest first."""
    reasons = ["dead", "delayed"] if delayed else ["dead"]
    with engine.connect() as conn:
        rows = conn.execute(query("dead_list"), {"topic": topic, "reasons": reasons}).all()
    return [
        DeadRow(
            r.id,
            r.seq,
            r.topic,
            r.aggregateid,
            r.type,
            r.error,
            r.parked_at,
            int(r.held),
            r.request,
            r.reason,
            r.until,
            r.created_at,
            r.attempts,
            r.first_failed_at,
        )
        for r in rows
    ]


def matching_dead(
    engine: sa.Engine, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[DeadRow]:
    """The parked rows :func:`requeue` (or, with ``ids``, :func:`skip`) would change now.

    Those named by ``ids``, dead or delayed (and of ``topic``, when given), or the dead rows of
    ``topic``, or (neither) all dead rows; oldest first. Changes nothing.
    """
    if ids is None:
        return list_dead(engine, topic=topic)
    named = set(ids)
    return [row for row in list_dead(engine, topic=topic, delayed=True) if row.id in named]


Bind = sa.Engine | sa.Connection
"""An engine (the function runs its own transaction) or a connection in the caller's open
transaction (it runs there, and the caller commits)."""


@contextmanager
def _transaction(bind: Bind) -> Iterator[sa.Connection]:
    if isinstance(bind, sa.Connection):
        yield bind
        return
    with bind.begin() as conn:
        yield conn


def _request(
    bind: Bind, request: str, *, ids: Sequence[UUID] | None, topic: str | None
) -> list[ChangedRow]:
    with _transaction(bind) as conn:
        rows = conn.execute(
            query("dead_request"),
            {"request": request, "ids": list(ids) if ids is not None else None, "topic": topic},
        ).all()
    return [ChangedRow(r.id, r.topic, r.aggregateid) for r in rows]


def requeue(
    bind: Bind, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[ChangedRow]:
    """Ask for the dead or delayed rows named by ``ids``, or the dead rows of ``topic``, or
    (neither) all dead rows, to be published now, then the rows held behind their keys; a
    running relay carries it out."""
    return _request(bind, "requeue", ids=ids, topic=topic)


def skip(bind: Bind, *, ids: Sequence[UUID]) -> list[ChangedRow]:
    """Ask for the named dead or delayed rows to be given up (never published): their held rows
    are published without them."""
    return _request(bind, "skip", ids=ids, topic=None)
