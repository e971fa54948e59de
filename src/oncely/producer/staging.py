"""``stage()``: add events to the outbox inside the caller's own transaction.

The outbox row is written by the caller's ``Session``, ``AsyncSession`` or ``Connection`` and
commits or rolls back with the business rows: nothing here commits. With a ``Session`` or a
``Connection`` the INSERT runs at once (one statement for a batch), so a duplicate event key
fails right at ``stage()``; with an ``AsyncSession`` the row joins the unit of work and is
inserted at the next flush, so ``stage()`` stays a plain call without I/O.

An insert trigger notifies ``oncely_outbox`` at commit, so an idle relay wakes immediately.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, registry

from oncely.errors import OncelyError
from oncely.events import registry_of
from oncely.producer.ids import uuid7
from oncely.schemas.codec import Codec
from oncely.storage.tables import outbox

Transactional = Session | AsyncSession | sa.Connection
"""What ``stage()`` writes through: the caller's session or connection."""


class DuplicateInTransactionError(OncelyError):
    """The same event key was staged twice in one transaction."""


@dataclass(frozen=True, kw_only=True)
class StagedEvent:
    """What was added to the outbox (it becomes durable when the caller commits)."""

    id: UUID
    event_key: str
    type: str
    topic: str
    aggregatetype: str
    aggregateid: str
    headers: Mapping[str, str]
    payload: bytes


class _OutboxRow:
    """ORM mapping of ``oncely_outbox`` so an ``AsyncSession`` can ``add`` rows without I/O."""

    def __init__(self, **columns: Any) -> None:
        self.__dict__.update(columns)


registry().map_imperatively(_OutboxRow, outbox)

_codecs: weakref.WeakKeyDictionary[Any, Codec] = weakref.WeakKeyDictionary()
_keys_in_transaction: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _codec_for(event: BaseModel) -> Codec:
    event_registry = registry_of(type(event))
    codec = _codecs.get(event_registry)
    if codec is None:
        codec = _codecs[event_registry] = Codec(registry=event_registry)
    return codec


def _transaction_of(target: Transactional) -> Any:
    """The caller's current (root) transaction, or ``None`` before one has begun."""
    sync = target.sync_session if isinstance(target, AsyncSession) else target
    return sync.get_transaction()


def _current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the active OpenTelemetry span, if OpenTelemetry is in use."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def _row(
    event: BaseModel,
    codec: Codec,
    event_key: str | None,
    headers: Mapping[str, str] | None,
    available_at: datetime | None,
    traceparent: str | None,
) -> dict[str, Any]:
    event_type = codec.registry.for_model(type(event))
    payload, codec_headers = codec.encode(event)
    event_id = uuid7()
    row_headers = dict(headers or {})
    if traceparent is not None:
        row_headers.setdefault("traceparent", traceparent)
    row_headers.update(codec_headers)
    row: dict[str, Any] = {
        "id": event_id,
        "aggregatetype": event_type.aggregate,
        "aggregateid": event_type.key_of(event),
        "type": event_type.name,
        "topic": event_type.topic,
        "payload": payload,
        "headers": row_headers,
        "event_key": event_key if event_key is not None else str(event_id),
    }
    if available_at is not None:
        row["available_at"] = available_at
    return row


def stage_many(
    target: Transactional,
    events: Iterable[BaseModel],
    *,
    codec: Codec | None = None,
    event_keys: Iterable[str | None] | None = None,
    headers: Mapping[str, str] | None = None,
    available_at: datetime | None = None,
) -> list[StagedEvent]:
    """Stage several events in the caller's transaction (one multi-row INSERT).

    ``event_keys``, when given, pairs one key (or ``None`` for the event id) with each event.
    Raises the same errors as :func:`stage`; on an error nothing of the batch is added.
    """
    batch = list(events)
    keys = list(event_keys) if event_keys is not None else [None] * len(batch)
    if len(keys) != len(batch):
        raise ValueError(f"{len(batch)} events but {len(keys)} event keys")
    traceparent = _current_traceparent()
    rows = [
        _row(event, codec or _codec_for(event), key, headers, available_at, traceparent)
        for event, key in zip(batch, keys, strict=True)
    ]
    before = _transaction_of(target)
    seen = _keys_in_transaction.get(before, set()) if before is not None else set()
    new_keys = [row["event_key"] for row in rows]
    repeated = sorted({k for k in new_keys if k in seen or new_keys.count(k) > 1})
    if repeated:
        raise DuplicateInTransactionError(
            f"event key {repeated[0]!r} is staged twice in one transaction; give each event "
            "its own event_key (or leave it None to use the event id)"
        )
    if isinstance(target, AsyncSession):
        target.add_all([_OutboxRow(**row) for row in rows])
    elif rows:
        target.execute(sa.insert(outbox), rows)
    # Adding or executing begins the transaction if none had begun: remember the keys there.
    _keys_in_transaction.setdefault(_transaction_of(target), set()).update(new_keys)
    return [
        StagedEvent(
            id=row["id"],
            event_key=row["event_key"],
            type=row["type"],
            topic=row["topic"],
            aggregatetype=row["aggregatetype"],
            aggregateid=row["aggregateid"],
            headers=row["headers"],
            payload=row["payload"],
        )
        for row in rows
    ]


def stage(
    target: Transactional,
    event: BaseModel,
    *,
    codec: Codec | None = None,
    event_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    available_at: datetime | None = None,
) -> StagedEvent:
    """Add one event to the outbox in the caller's transaction; it is published after commit.

    Args:
        target: the caller's ``Session``, ``AsyncSession`` or ``Connection``, inside the
            business transaction. Nothing is committed or flushed here.
        event: an instance of a model declared with ``@registry.event(...)``.
        codec: how to encode it; by default a codec of the model's registry (pass one to use
            a schema registry or a schema catalog).
        event_key: the producer's stable idempotency key (default: the new event id).
        headers: extra Kafka headers (the codec's ``content-type`` and ``schema-version`` and
            the active OpenTelemetry ``traceparent`` are added).
        available_at: do not publish before this time.

    Raises:
        UnknownEventTypeError: the model is not a registered event type.
        EncodeError: the event does not fit its schema.
        DuplicateInTransactionError: ``event_key`` was already staged in this transaction.
        DuplicateEventKeyError: ``event_key`` was staged by an earlier transaction (with an
            ``AsyncSession``: at flush or commit).
    """
    [staged] = stage_many(
        target,
        [event],
        codec=codec,
        event_keys=[event_key],
        headers=headers,
        available_at=available_at,
    )
    return staged
