"""The store of ``oncely_retention_marks``: Kafka's high watermarks marked for a receipts
partition when it first became otherwise droppable (see :mod:`oncely.retention.guard`).

Retention records a partition's mark (:func:`record`), reads it at each later run instead of
scanning the partition again (:func:`marks_of`) and discards it with the partition, or when the
outbox holds the partition's events again (:func:`discard`). Every statement runs in the
caller's transaction; the named SQL is in ``storage/sql/retention.sql``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from oncely.storage.queries import query, typed_row

#: The partition number of a mark's row for a topic that did not exist when it was taken.
ABSENT = -1


@dataclass(frozen=True, slots=True)
class MarkRow:
    """One (topic, partition) of a mark: Kafka's high watermark there when the mark was taken
    (``partition`` :data:`ABSENT`: the topic did not exist), and the highest offset receipted
    there then (``None``: none)."""

    topic: str
    partition: int
    high: int
    receipted: int | None


def marks_of(conn: sa.Connection, receipts_partition: str) -> list[MarkRow]:
    """The mark of ``receipts_partition``, by topic and partition; empty: it has none."""
    rows = conn.execute(query("retention_marks_of"), {"receipts_partition": receipts_partition})
    return [typed_row(MarkRow, row._mapping) for row in rows]


def record(conn: sa.Connection, receipts_partition: str, rows: Sequence[MarkRow]) -> None:
    """Record ``rows`` as the mark of ``receipts_partition``, replacing any it had."""
    discard(conn, receipts_partition)
    if rows:
        conn.execute(
            query("retention_mark_insert"),
            [
                {
                    "receipts_partition": receipts_partition,
                    "topic": row.topic,
                    "partition": row.partition,
                    "high": row.high,
                    "receipted": row.receipted,
                }
                for row in rows
            ],
        )


def discard(conn: sa.Connection, receipts_partition: str) -> None:
    """Forget the mark of ``receipts_partition`` (none: nothing happens)."""
    conn.execute(query("retention_marks_discard"), {"receipts_partition": receipts_partition})
