"""The store of ``oncely_dead_lettered``: the records an effect's consumer dead-lettered.

A dead-lettered record gets no receipt (so that a redrive applies it); the consumer records it
here (:func:`record`) once its DLQ topic confirmed it and before committing past it, so that
completeness counts the event as dead for that effect, not missing. Completeness reads it
through the receipts' store (:mod:`oncely.storage.stores.receipts`). The named SQL is in
``storage/sql/dead_lettered.sql``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query, typed_row


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An effect's consumer sent the record of event ``event_id`` (read at ``topic``,
    ``partition``, ``offset``) to its DLQ for ``reason``."""

    event_id: UUID
    effect: str
    topic: str
    partition: int
    offset: int
    reason: str
    dead_lettered_at: datetime


def record(
    engine: sa.Engine,
    *,
    effect: str,
    event_id: UUID,
    topic: str,
    partition: int,
    offset: int,
    reason: str,
) -> None:
    """Record that ``effect`` dead-lettered the event ``event_id`` (read at ``topic``,
    ``partition``, ``offset``) for ``reason``, in a transaction of its own; an event already
    recorded keeps its first row. Raises SQLAlchemy's errors."""
    with engine.begin() as conn:
        conn.execute(
            query("dead_lettered_record"),
            {
                "event_id": event_id,
                "effect": effect,
                "topic": topic,
                "partition": partition,
                "offset": offset,
                "reason": reason,
            },
        )


def of_event(conn: sa.Connection, event_id: UUID) -> list[DeadLetter]:
    """The dead letters of ``event_id``, one per effect that dead-lettered it, by effect."""
    rows = conn.execute(query("lookup_dead_lettered"), {"id": event_id})
    return [typed_row(DeadLetter, row._mapping) for row in rows]


def unapplied(conn: sa.Connection, *, limit: int) -> list[DeadLetter]:
    """The newest ``limit`` dead letters whose event the effect has not applied since."""
    rows = conn.execute(query("dead_lettered_recent"), {"limit": limit})
    return [typed_row(DeadLetter, row._mapping) for row in rows]
