"""Turning a consumed Kafka record into (event id, event), or the reason it cannot be applied.

Records from oncely's relay and from Debezium's Outbox Event Router look the same
(:mod:`oncely.wire`): the event id is the ``id`` header (36-character UUID text), the event type
comes from the topic's registered type (the ``eventType`` header must agree when present), and
the value is decoded by the codec. :func:`read_envelope` reads everything but the value, so that a
consumer can find the duplicates first and decode (and build models for) only the new events
with :func:`decode_event`.

Hostile records (random bytes, truncated or foreign Avro, non-UTF-8 or oversized headers, a
missing or malformed ``id``) become :class:`Undecodable` with the reason; a fuzz test holds
:func:`read_envelope` and :func:`decode_event` to never raising and never hanging.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from confluent_kafka import Message

from oncely.events import EventType
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeError, DecodeFailure
from oncely.wire import EVENT_TYPE_HEADER, ID_HEADER, text_headers


@dataclass(frozen=True, slots=True)
class Envelope:
    """A record whose headers, event id and event type are valid; its value is not decoded yet
    (a duplicate never needs it)."""

    message: Message
    event_id: UUID
    event_type: EventType[Any]
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Decoded:
    """An envelope and the event its value holds."""

    envelope: Envelope
    event: Any


@dataclass(frozen=True, slots=True)
class Undecodable:
    message: Message
    reason: str
    failure: DecodeFailure | None = None
    """The codec's classification, when the value itself could not be decoded."""


def read_envelope(
    message: Message, *, types_by_topic: Mapping[str, EventType[Any]]
) -> Envelope | Undecodable:
    """The envelope of ``message`` for an effect consuming ``types_by_topic``; never raises."""
    headers = text_headers(message)
    if isinstance(headers, str):
        return Undecodable(message, headers)
    event_type = types_by_topic.get(message.topic() or "")
    if event_type is None:
        return Undecodable(message, f"topic {message.topic()!r} carries no declared event type")
    declared = headers.get(EVENT_TYPE_HEADER)
    if declared is not None and declared != event_type.name:
        return Undecodable(
            message,
            f"{EVENT_TYPE_HEADER} header {declared!r} is not {event_type.name!r} of this topic",
        )
    raw_id = headers.get(ID_HEADER)
    if raw_id is None:
        return Undecodable(message, "no 'id' header: the event id is unknown")
    try:
        event_id = UUID(raw_id)
    except ValueError:
        return Undecodable(message, f"'id' header {raw_id[:64]!r} is not a UUID")
    if message.value() is None:
        return Undecodable(message, "the record has no value (a tombstone)")
    return Envelope(message, event_id, event_type, headers)


def decode_event(envelope: Envelope, *, codec: Codec) -> Decoded | Undecodable:
    """The event held by ``envelope``'s value, validated by its model; never raises."""
    try:
        event = codec.decode(
            envelope.message.value() or b"", envelope.headers, expected=envelope.event_type.model
        )
    except DecodeError as exc:
        return Undecodable(envelope.message, str(exc), exc.reason)
    return Decoded(envelope, event)
