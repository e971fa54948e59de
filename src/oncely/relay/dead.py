"""Dead letters of the outbox: list them, requeue them (attempts reset) or skip them.

A dead row parks its key: later rows of the same ``aggregateid`` wait behind it. Requeueing
makes it due again with its attempts reset; skipping marks it ``skipped`` (kept for audit) and
lets the key flow on without it.
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
    seq: int
    topic: str
    aggregateid: str
    type: str
    attempts: int
    last_error: str | None
    created_at: datetime


@dataclass(frozen=True)
class ChangedRow:
    id: UUID
    topic: str
    aggregateid: str
    type: str


def list_dead(engine: sa.Engine, *, topic: str | None = None) -> list[DeadRow]:
    with engine.connect() as conn:
        rows = conn.execute(query("outbox_dead_list"), {"topic": topic}).all()
    return [
        DeadRow(r.id, r.seq, r.topic, r.aggregateid, r.type, r.attempts, r.last_error, r.created_at)
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


def requeue(
    engine: sa.Engine, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[ChangedRow]:
    """Requeue the dead rows named by ``ids``, or of ``topic``, or (neither) all of them."""
    with engine.begin() as conn:
        rows = conn.execute(
            query("outbox_dead_requeue"),
            {"ids": list(ids) if ids is not None else None, "topic": topic},
        ).all()
    return [ChangedRow(r.id, r.topic, r.aggregateid, r.type) for r in rows]


def skip(engine: sa.Engine, *, ids: Sequence[UUID]) -> list[ChangedRow]:
    """Mark the named dead rows skipped; their keys flow on."""
    with engine.begin() as conn:
        rows = conn.execute(query("outbox_dead_skip"), {"ids": list(ids)}).all()
    return [ChangedRow(r.id, r.topic, r.aggregateid, r.type) for r in rows]
