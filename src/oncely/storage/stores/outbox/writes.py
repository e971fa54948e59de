"""How producers add outbox rows: in the caller's own transaction, never committing it; and
what a transaction has added so far."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, registry

from oncely.storage.tables import outbox


class _OutboxRow:
    """ORM mapping of ``oncely_outbox`` so an ``AsyncSession`` can ``add`` rows without I/O."""

    def __init__(self, **columns: Any) -> None:
        self.__dict__.update(columns)


registry().map_imperatively(_OutboxRow, outbox)


@dataclass(frozen=True, kw_only=True)
class StagedEvent:
    """What was added to the outbox (it becomes durable when the caller commits)."""

    id: UUID
    idempotency_key: str
    """The producer's idempotency key (the outbox's ``event_key`` column)."""
    type: str
    topic: str
    aggregatetype: str
    aggregateid: str
    headers: Mapping[str, str]
    payload: bytes


def add_rows(
    target: Session | AsyncSession | sa.Connection, rows: Sequence[Mapping[str, Any]]
) -> None:
    """Add ``rows`` (column -> value) to the outbox in ``target``'s transaction.

    An ``AsyncSession`` gets them as pending objects, written at its next flush (so this never
    awaits); a ``Session`` or ``Connection`` executes one ``INSERT`` now. Either way they become
    durable only when the caller commits.
    """
    if isinstance(target, AsyncSession):
        target.add_all([_OutboxRow(**row) for row in rows])
    elif rows:
        target.execute(sa.insert(outbox), rows)


def staged_in(session: Session) -> list[StagedEvent]:
    """The rows ``session``'s current transaction has added so far, in ``seq`` order."""
    columns = outbox.c
    rows = session.execute(
        sa.select(
            columns.id,
            columns.event_key,
            columns.type,
            columns.topic,
            columns.aggregatetype,
            columns.aggregateid,
            columns.headers,
            columns.payload,
        )
        .where(columns.txid == sa.func.pg_current_xact_id())
        .order_by(columns.seq)
    )
    return [
        StagedEvent(
            id=row.id,
            idempotency_key=row.event_key,
            type=row.type,
            topic=row.topic,
            aggregatetype=row.aggregatetype,
            aggregateid=row.aggregateid,
            headers=row.headers or {},
            payload=bytes(row.payload),
        )
        for row in rows
    ]
