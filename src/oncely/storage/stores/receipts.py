"""The store of ``oncely_receipts``: one row per (event id, effect) applied.

A consumer inserts receipts in the effect's own transaction (:func:`insert_receipts` for a run
of records, :func:`insert_receipt` for one), and only the primary key's conflict means "already
applied". Operators count them (:func:`applied_by_effect`), check them against the outbox
(:func:`effect_summary`, :func:`not_applied`, :func:`out_of_order`) and purge old ones
(:func:`preview_purge`, :func:`purge`); the test harness waits on them
(:func:`applied_pairs`). Completeness (:mod:`oncely.consumers.completeness`) compares them with
the outbox by id range (:func:`completeness_bounds`, :func:`bucket_counts`,
:func:`missing_events`). The named SQL is in ``storage/sql/receipts.sql``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.storage.queries import driver_query, purge_in_batches, query, run_on_driver, typed_row


def insert_receipts(
    session: Session,
    *,
    effect: str,
    event_ids: Sequence[str],
    topics: Sequence[str | None],
    partitions: Sequence[int | None],
    offsets: Sequence[int | None],
) -> set[str]:
    """Insert the receipts of a run of records (one per position of the sequences, as Kafka's
    ``Message`` gives them) in one statement; return the event ids that already had a receipt,
    as canonical UUID text (lowercase, with hyphens: pass ``event_ids`` so spelled to compare).
    A second copy of an event id in the same run is not returned: the caller tells it apart.

    The arrays go to the database in binary, one parameter each, in ``session``'s transaction.
    """
    rows = run_on_driver(
        session.connection(),
        driver_query("receipts_insert_many"),
        {
            "effect": effect,
            "event_ids": event_ids,
            "topics": topics,
            "partitions": partitions,
            "offsets": offsets,
        },
    )
    return {row[0] for row in rows}


def insert_receipt(
    session: Session,
    *,
    effect: str,
    event_id: UUID,
    topic: str | None,
    partition: int | None,
    offset: int | None,
) -> bool:
    """Insert one receipt; ``False`` when the event already had one for ``effect``."""
    inserted = session.execute(
        query("receipt_insert"),
        {
            "event_id": event_id,
            "effect": effect,
            "topic": topic,
            "partition": partition,
            "offset": offset,
        },
    ).first()
    return inserted is not None


@dataclass(frozen=True, slots=True)
class EffectReceipts:
    """An effect's receipts in all, and those of the last ``recent_seconds``."""

    effect: str
    applied: int
    applied_recently: int


def applied_by_effect(conn: sa.Connection, *, recent_seconds: float) -> list[EffectReceipts]:
    """Every effect name found in the receipts, by name."""
    rows = conn.execute(query("ops_receipts_by_effect"), {"recent_seconds": recent_seconds})
    return [EffectReceipts(r.effect, int(r.applied), int(r.applied_recently)) for r in rows]


@dataclass(frozen=True, slots=True)
class EffectSummary:
    """An effect over a window: ``expected`` published events of its types, ``applied``."""

    expected: int
    applied: int


@dataclass(frozen=True, slots=True)
class OutOfOrder:
    """``id`` was applied before ``previous_id``, the earlier event of its key."""

    id: UUID
    previous_id: UUID


def effect_summary(conn: sa.Connection, window: dict[str, Any]) -> EffectSummary:
    """``window``: ``since``, ``until``, ``max_pending_age``, ``effect``, ``types``, ``limit``."""
    counts = conn.execute(query("verify_effect_summary"), window).one()
    return EffectSummary(int(counts.expected), int(counts.applied))


def not_applied(conn: sa.Connection, window: dict[str, Any]) -> list[UUID]:
    """Up to ``limit`` published events of the window's types without the effect's receipt."""
    return list(conn.execute(query("verify_not_applied"), window).scalars())


def out_of_order(conn: sa.Connection, window: dict[str, Any]) -> tuple[int, list[OutOfOrder]]:
    """How many of the effect's receipts came before an earlier event of their key, and up to
    ``limit`` of them."""
    rows = conn.execute(query("verify_out_of_order"), window).all()
    total = int(rows[0].total) if rows else 0
    return total, [OutOfOrder(row.id, row.previous_id) for row in rows[: window["limit"]]]


@dataclass(frozen=True)
class ReceiptsPurge:
    """The receipts a purge would delete now: how many, and the oldest one's ``applied_at``."""

    receipts: int
    oldest_applied_at: datetime | None


def preview_purge(engine: sa.Engine, *, effect: str, older_than_seconds: float) -> ReceiptsPurge:
    """What :func:`purge` would delete now; changes nothing."""
    with engine.connect() as conn:
        row = conn.execute(
            query("receipts_purge_preview"),
            {"effect": effect, "older_than": older_than_seconds},
        ).one()
    return ReceiptsPurge(int(row.receipts), row.oldest_applied_at)


def purge(engine: sa.Engine, *, effect: str, older_than_seconds: float, batch_size: int) -> int:
    """Delete ``effect``'s receipts older than ``older_than_seconds``, ``batch_size`` rows per
    transaction; return how many."""
    params = {"effect": effect, "older_than": older_than_seconds}
    return purge_in_batches(engine, "receipts_purge", params, batch_size=batch_size)


@dataclass(frozen=True, slots=True)
class Receipt:
    """An effect's receipt of one event: where it read the record (``topic``, ``partition``,
    ``offset``; ``None`` for receipts written without them) and when it applied it."""

    effect: str
    topic: str | None
    partition: int | None
    offset: int | None
    applied_at: datetime
    outcome: str


def applied_pairs(
    conn: sa.Connection, event_ids: Sequence[UUID], effects: Sequence[str]
) -> set[tuple[UUID, str]]:
    """The (event id, effect) pairs of ``event_ids`` and ``effects`` that have a receipt (the
    test harness waits on them: :meth:`oncely.testing.Pipeline.wait_until_applied`)."""
    rows = conn.execute(query("receipts_applied"), {"ids": event_ids, "effects": effects})
    return {(row.event_id, row.effect) for row in rows}


def receipts_of(conn: sa.Connection, event_id: UUID) -> list[Receipt]:
    """The receipts of ``event_id``, one per effect that applied it, by effect name."""
    rows = conn.execute(query("lookup_receipts"), {"id": event_id})
    return [typed_row(Receipt, row._mapping) for row in rows]


@dataclass(frozen=True, slots=True)
class CompletenessBounds:
    """The oldest event id still in the outbox (``None``: it is empty), and the database clock
    in milliseconds since the epoch."""

    oldest_id: UUID | None
    now_ms: int


def completeness_bounds(conn: sa.Connection) -> CompletenessBounds:
    """Where a completeness window can start, and the clock it ends by."""
    row = conn.execute(query("completeness_bounds")).one()
    return CompletenessBounds(row.oldest_id, int(row.now_ms))


@dataclass(frozen=True, slots=True)
class BucketCounts:
    """One id range: the outbox rows of an effect's event types (``events``, and the sum of
    their ids' hashes) and the events the effect applied or dead-lettered (``done``, and the
    sum of theirs)."""

    events: int
    events_hash: int
    done: int
    done_hash: int


def bucket_counts(
    conn: sa.Connection,
    *,
    effect: str,
    types: Sequence[str],
    lows: Sequence[UUID],
    highs: Sequence[UUID],
) -> list[BucketCounts]:
    """The counts of each id range ``[lows[i], highs[i])``, in order, from the primary keys'
    indexes (the outbox's rows are read for their type)."""
    rows = conn.execute(
        query("completeness_buckets"),
        {"effect": effect, "types": list(types), "lows": list(lows), "highs": list(highs)},
    )
    return [
        BucketCounts(int(r.events), int(r.events_hash), int(r.done), int(r.done_hash)) for r in rows
    ]


@dataclass(frozen=True, slots=True)
class MissingEvents:
    """Published events an effect has neither applied nor dead-lettered: how many, the oldest
    one's ``created_at``, and the first ids (oldest first)."""

    missing: int
    oldest_created_at: datetime | None
    sample: list[UUID]


def missing_events(
    conn: sa.Connection,
    *,
    effect: str,
    types: Sequence[str],
    lows: Sequence[UUID],
    highs: Sequence[UUID],
    limit: int,
) -> MissingEvents:
    """The events of ``types`` in the id ranges ``[lows[i], highs[i])`` that ``effect`` is
    expected to have applied and has not (published, not skipped, no receipt, no dead letter),
    read row by row; at most ``limit`` ids."""
    if not lows:
        return MissingEvents(0, None, [])
    row = conn.execute(
        query("completeness_missing"),
        {
            "effect": effect,
            "types": list(types),
            "lows": list(lows),
            "highs": list(highs),
            "limit": limit,
        },
    ).one()
    return MissingEvents(int(row.missing), row.oldest_created_at, list(row.sample))
