"""Helpers for an application's own tests: apply an event to an effect inside the test's
transaction, and read what a transaction staged, with real PostgreSQL and no Kafka.

:func:`apply_event` takes the consumer's own path (the record's headers as the relay writes
them, the receipt, the handler, the ``ctx.insert``/``ctx.upsert`` writes) in a savepoint of the
test's session, so a test that rolls back leaves nothing behind::

    with Session(engine) as session, session.begin():
        assert apply_event(effects, "send-receipt", OrderPaid(order_id="o-1"), session)
        assert not apply_event(effects, "send-receipt", same_event, session, event_id=first_id)
        session.rollback()
"""

from __future__ import annotations

import uuid
from typing import cast

import sqlalchemy as sa
from confluent_kafka import Message
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from oncely.consumers.apply import Applier, Record
from oncely.consumers.effects import Effects
from oncely.consumers.records import read_envelope
from oncely.errors import ConfigurationError
from oncely.ids import uuid7
from oncely.runtime.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.storage.stores.outbox.writes import StagedEvent, staged_in
from oncely.wire import record_headers

__all__ = ["apply_event", "apply_event_async", "staged_events"]


def apply_event(
    effects: Effects,
    effect: str,
    event: BaseModel,
    session: Session,
    *,
    event_id: uuid.UUID | None = None,
    codec: Codec | None = None,
) -> bool:
    """Apply ``event`` to the effect named ``effect`` in ``session``'s transaction, as its
    consumer would; return ``True`` when it was applied, ``False`` when a receipt for
    ``(event_id, effect)`` already existed (a redelivery: the handler was not called).

    ``event_id`` defaults to a new one; pass the same id twice to test a redelivery. ``codec``
    defaults to one over the effects' registry (without a schema catalog). An ``async``
    effect takes :func:`apply_event_async`.

    Raises:
        ConfigurationError: the effect is ``async``, or does not consume ``event``'s type.
        Exception: whatever the handler or its writes raise; the savepoint is rolled back, so
            neither the receipt nor the writes remain.
    """
    target = effects.get(effect)
    if target.is_async:
        raise ConfigurationError(
            f"effect {effect!r} is async: apply it with apply_event_async on an AsyncSession"
        )
    record, codec = _record(effects, effect, event, event_id, codec)
    engine = cast(sa.Engine, session.get_bind())
    applier = Applier(target, engine, ConsumerMetrics(), codec)
    return applier.apply_in(session, [record]).applied == 1


async def apply_event_async(
    effects: Effects,
    effect: str,
    event: BaseModel,
    session: AsyncSession,
    *,
    event_id: uuid.UUID | None = None,
    codec: Codec | None = None,
) -> bool:
    """:func:`apply_event` for an ``async`` effect, in ``session``'s transaction: its handler
    gets ``ctx.session`` as this ``AsyncSession`` and is awaited, as its consumer does.

    Raises:
        ConfigurationError: the effect is not ``async`` (use :func:`apply_event`), or does not
            consume ``event``'s type.
        Exception: whatever the handler or its writes raise; the savepoint is rolled back.
    """
    target = effects.get(effect)
    if not target.is_async:
        raise ConfigurationError(f"effect {effect!r} is not async: apply it with apply_event")
    record, codec = _record(effects, effect, event, event_id, codec)
    async_engine = cast(AsyncEngine, session.bind)
    applier = Applier(target, async_engine.sync_engine, ConsumerMetrics(), codec, async_engine)
    return (await applier.apply_in_async(session, [record])).applied == 1


def _record(
    effects: Effects,
    effect: str,
    event: BaseModel,
    event_id: uuid.UUID | None,
    codec: Codec | None,
) -> tuple[Record, Codec]:
    """The record the relay would publish for ``event``, as the consumer reads it."""
    event_type = effects.registry.for_model(type(event))
    if event_type not in effects.get(effect).event_types:
        raise ConfigurationError(
            f"effect {effect!r} does not consume {event_type.name!r}: pass one of its events"
        )
    codec = codec or Codec(registry=effects.registry)
    value, headers = codec.encode(event)
    own = tuple((name, text.encode()) for name, text in headers.items())
    message = Message(
        topic=event_type.topic,
        partition=0,
        offset=0,
        key=event_type.key_of(event).encode(),
        value=value,
        headers=record_headers(str(event_id or uuid7()), event_type.name, own),
    )
    return read_envelope(message, types_by_topic={event_type.topic: event_type}), codec


def staged_events(session: Session) -> list[StagedEvent]:
    """The events staged in ``session``'s current transaction so far, in staging order (read
    back from ``oncely_outbox``: what the relay will publish once the transaction commits)."""
    return staged_in(session)
