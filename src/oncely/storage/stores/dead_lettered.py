"""The store of ``oncely_dead_lettered``: the records an effect's consumer dead-lettered.

A dead-lettered record gets no receipt (so that a redrive applies it); the consumer records it
here (:func:`record`) once its DLQ topic confirmed it and before committing past it, so that
completeness counts the event as dead for that effect, not missing. Completeness reads it
through the receipts' store (:mod:`oncely.storage.stores.receipts`). The named SQL is in
``storage/sql/dead_lettered.sql``.
"""

from __future__ import annotations

from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query


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
