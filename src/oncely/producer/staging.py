"""``stage()``: add events to the outbox inside the caller's own transaction.

The outbox row is written in the transaction of the caller's ``Session``, ``AsyncSession`` or
``Connection`` and commits or rolls back with the business rows: nothing here commits. With a
``Session`` or a ``Connection`` the INSERT runs at once (one statement for a batch), so a
duplicate event key fails right at ``stage()``; with an ``AsyncSession`` the row joins the unit
of work and is inserted at the next flush, so ``stage()`` stays a plain call without I/O
(:mod:`oncely.storage.transactional`, as ``enqueue_task()``).

An insert trigger notifies ``oncely_outbox`` at commit while a relay sleeps, so it wakes at
once.

Each event is checked against :class:`~oncely.settings.StageLimits` (payload size, key length,
headers) before anything is added: an event the relay could never publish fails at
``stage()``, inside the caller's transaction, not later in the relay.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

from pydantic import BaseModel

from oncely.errors import OncelyError
from oncely.events import registry_of
from oncely.ids import uuid7
from oncely.runtime.tracing import current_context_text
from oncely.schemas.codec import Codec
from oncely.settings import StageLimits
from oncely.storage.stores.outbox.writes import StagedEvent, add_rows
from oncely.storage.tables import TRACE_CONTEXT_COLUMN
from oncely.storage.transactional import Transactional


class StageLimitError(OncelyError):
    """The event exceeds a limit of what can be staged (see ``StageLimits``)."""


class PayloadTooLargeError(StageLimitError):
    """The encoded event is larger than ONCELY_STAGE_MAX_PAYLOAD_BYTES."""


class KeyTooLongError(StageLimitError):
    """The event's aggregate id (its Kafka key) is longer than ONCELY_STAGE_MAX_KEY_BYTES."""


class HeadersTooLargeError(StageLimitError):
    """The event has more headers, or larger ones, than ONCELY_STAGE_MAX_HEADERS[_BYTES]."""


@cache
def default_limits() -> StageLimits:
    """The limits from the ``ONCELY_STAGE_*`` environment, read once per process."""
    return StageLimits()


def check_limits(row: Mapping[str, Any], limits: StageLimits) -> None:
    """Raise a :class:`StageLimitError` subclass if the outbox ``row`` exceeds ``limits``.

    Each message names the event type, the measured size, the limit, its setting and the way
    out; no event content is quoted (it may be personal data).
    """
    kind = row["type"]
    payload = len(row["payload"])
    if payload > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"event type {kind!r}: the encoded event is {payload:,} bytes, over the limit of "
            f"{limits.max_payload_bytes:,} (ONCELY_STAGE_MAX_PAYLOAD_BYTES or "
            "stage(limits=...)). Store large content elsewhere (object storage) and put its "
            "reference in the event; raising the limit also needs the topic's "
            "max.message.bytes and the relay's message.max.bytes (ONCELY_KAFKA_EXTRA) raised"
        )
    key = len(row["aggregateid"].encode())
    if key > limits.max_key_bytes:
        raise KeyTooLongError(
            f"event type {kind!r}: the aggregate id (Kafka key) is {key:,} bytes, over the "
            f"limit of {limits.max_key_bytes:,} (ONCELY_STAGE_MAX_KEY_BYTES): use a short "
            "stable id (a UUID or a database key) as the key field"
        )
    headers: Mapping[str, str] = row["headers"]
    if len(headers) > limits.max_headers:
        raise HeadersTooLargeError(
            f"event type {kind!r}: {len(headers)} headers, over the limit of "
            f"{limits.max_headers} (ONCELY_STAGE_MAX_HEADERS): put data in the event instead"
        )
    size = sum(
        len(str(name).encode()) + len(str(value).encode()) for name, value in headers.items()
    )
    if size > limits.max_headers_bytes:
        raise HeadersTooLargeError(
            f"event type {kind!r}: the headers take {size:,} bytes, over the limit of "
            f"{limits.max_headers_bytes:,} (ONCELY_STAGE_MAX_HEADERS_BYTES): headers are for "
            "small metadata (trace context, content type), put data in the event"
        )


_codecs: weakref.WeakKeyDictionary[Any, Codec] = weakref.WeakKeyDictionary()


def _codec_for(event: BaseModel) -> Codec:
    event_registry = registry_of(type(event))
    codec = _codecs.get(event_registry)
    if codec is None:
        codec = _codecs[event_registry] = Codec(registry=event_registry)
    return codec


def _row(
    event: BaseModel,
    codec: Codec,
    event_key: str | None,
    headers: Mapping[str, str] | None,
    available_at: datetime | None,
    trace_context: str | None,
) -> dict[str, Any]:
    event_type = codec.registry.for_model(type(event))
    payload, codec_headers = codec.encode(event)
    event_id = uuid7()
    row_headers = dict(headers or {})
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
    if trace_context is not None:
        row[TRACE_CONTEXT_COLUMN] = trace_context
    return row


def outbox_rows(
    events: Sequence[BaseModel],
    *,
    codec: Codec | None = None,
    idempotency_keys: Sequence[str | None] | None = None,
    headers: Mapping[str, str] | None = None,
    available_at: datetime | None = None,
    limits: StageLimits | None = None,
    trace_context: str | None = None,
) -> list[dict[str, Any]]:
    """The outbox rows of ``events`` (column -> value), encoded and checked against
    ``limits``, each with a new event id: what :func:`stage_many` adds, for a caller that adds
    them itself later (an effect's follow-up events, written with its batch).

    Raises the errors of :func:`stage` but the duplicate ones.
    """
    keys = list(idempotency_keys) if idempotency_keys is not None else [None] * len(events)
    if len(keys) != len(events):
        raise ValueError(f"{len(events)} events but {len(keys)} idempotency keys")
    rows = [
        _row(event, codec or _codec_for(event), key, headers, available_at, trace_context)
        for event, key in zip(events, keys, strict=True)
    ]
    for row in rows:
        check_limits(row, limits or default_limits())
    return rows


def staged_event(row: Mapping[str, Any]) -> StagedEvent:
    """What :func:`stage` returns for an outbox ``row`` of :func:`outbox_rows`."""
    return StagedEvent(
        id=row["id"],
        idempotency_key=row["event_key"],
        type=row["type"],
        topic=row["topic"],
        aggregatetype=row["aggregatetype"],
        aggregateid=row["aggregateid"],
        headers=row["headers"],
        payload=row["payload"],
    )


def stage_many(
    target: Transactional,
    events: Iterable[BaseModel],
    *,
    codec: Codec | None = None,
    idempotency_keys: Iterable[str | None] | None = None,
    headers: Mapping[str, str] | None = None,
    available_at: datetime | None = None,
    limits: StageLimits | None = None,
) -> list[StagedEvent]:
    """Stage several events in the caller's transaction (one multi-row INSERT).

    ``idempotency_keys``, when given, pairs one key (or ``None`` for the event id) with each
    event.
    Raises the same errors as :func:`stage`; on an error nothing of the batch is added.
    """
    rows = outbox_rows(
        list(events),
        codec=codec,
        idempotency_keys=list(idempotency_keys) if idempotency_keys is not None else None,
        headers=headers,
        available_at=available_at,
        limits=limits,
        trace_context=current_context_text(),
    )
    add_rows(target, rows)
    return [staged_event(row) for row in rows]


def stage(
    target: Transactional,
    event: BaseModel,
    *,
    codec: Codec | None = None,
    idempotency_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    available_at: datetime | None = None,
    limits: StageLimits | None = None,
) -> StagedEvent:
    """Add one event to the outbox in the caller's transaction; it is published after commit.

    Args:
        target: the caller's ``Session``, ``AsyncSession`` or ``Connection``, inside the
            business transaction. Nothing is committed or flushed here.
        event: an instance of a model declared with ``@registry.event(...)``.
        codec: how to encode it; by default a codec of the model's registry (pass one to use
            a schema registry or a schema catalog). With an ``avro-confluent`` event type
            ``stage()`` never calls the schema registry unless the codec was built with
            ``auto_register=True``: load the schema ids with :meth:`Codec.warm` at start-up.
        idempotency_key: the producer's stable key for this event (default: the new event
            id): staging it again raises :class:`~oncely.storage.DuplicateEventError` instead
            of a second event for as long as the outbox keeps the first one: until the relay's
            purge deletes it (``ONCELY_RELAY_RETENTION_SECONDS``) or, on partitioned tables,
            until retention drops its partition (which goes by the client's clock at staging).
            A retry after that stages a new event.
        headers: extra Kafka headers (the codec's ``content-type`` and ``schema-version`` are
            added). The active OpenTelemetry context (``traceparent``, ``tracestate``,
            ``baggage``) is stored with the row and travels on its record (see
            :mod:`oncely.runtime.tracing`).
        available_at: do not publish before this time.
        limits: the payload, key and header limits (default: ``StageLimits()`` from the
            ``ONCELY_STAGE_*`` environment, read once).

    Raises:
        UnknownEventTypeError: the model is not a registered event type.
        EncodeError: the event does not fit its schema.
        SchemaIdNotLoadedError: an ``avro-confluent`` schema id was not loaded (call
            ``codec.warm()`` at start-up); nothing was added.
        PayloadTooLargeError, KeyTooLongError, HeadersTooLargeError: the event exceeds
            ``limits`` (all are :class:`StageLimitError`); nothing was added.
        DuplicateInTransactionError: ``idempotency_key`` was already staged in this
            transaction.
        DuplicateEventError: ``idempotency_key`` was staged by an earlier transaction (with an
            ``AsyncSession``: at flush or commit).
    """
    [staged] = stage_many(
        target,
        [event],
        codec=codec,
        idempotency_keys=[idempotency_key],
        headers=headers,
        available_at=available_at,
        limits=limits,
    )
    return staged
