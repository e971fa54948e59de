"""Dead letters of the outbox: list them, and ask the relay to requeue or skip them.

A dead row parks its key: later rows of the same topic and key are held behind it. The relay
holding the key's shard carries out a request: ``requeue`` publishes the dead row, then the
held rows, in order (if the dead row fails again it stays dead); ``skip`` publishes only the
held rows and gives up on the dead one (its outbox row stays until purged, for audit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query


@dataclass(frozen=True)
class DeadRow:
    id: UUID
    seq: int | None
    topic: str
    aggregateid: str
    type: str | None
    error: str | None
    parked_at: datetime
    held: int
    request: str | None


@dataclass(frozen=True)
class ChangedRow:
    id: UUID
    topic: str
    aggregateid: str


def list_dead(engine: sa.Engine, *, topic: str | None = None) -> list[DeadRow]:
    with engine.connect() as conn:
        rows = conn.execute(query("dead_list"), {"topic": topic}).all()
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
        )
        for r in rows
    ]


def matching_dead(
    engine: sa.Engine, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[DeadRow]:
    """The dead rows :func:`requeue` (or, with ``ids``, :func:`skip`) would change now.

    Those named by ``ids`` (and of ``topic``, when given), or all of ``topic``, or (neither) all
    dead rows; oldest first. Changes nothing.
    """
    rows = list_dead(engine, topic=topic)
    if ids is None:
        return rows
    named = set(ids)
    return [row for row in rows if row.id in named]


def _request(
    engine: sa.Engine, request: str, *, ids: Sequence[UUID] | None, topic: str | None
) -> list[ChangedRow]:
    with engine.begin() as conn:
        rows = conn.execute(
            query("dead_request"),
            {"request": request, "ids": list(ids) if ids is not None else None, "topic": topic},
        ).all()
    return [ChangedRow(r.id, r.topic, r.aggregateid) for r in rows]


def requeue(
    engine: sa.Engine, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[ChangedRow]:
    """Ask for the dead rows named by ``ids``, or of ``topic``, or (neither) all, to be
    published again, then the rows held behind them; a running relay carries it out."""
    return _request(engine, "requeue", ids=ids, topic=topic)


def skip(engine: sa.Engine, *, ids: Sequence[UUID]) -> list[ChangedRow]:
    """Ask for the named dead rows to be given up: their held rows are published without them."""
    return _request(engine, "skip", ids=ids, topic=None)
