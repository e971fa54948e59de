"""Turning a consumed Kafka record into (event id, event), or the reason it cannot be applied.

Records from oncely's relay and from Debezium's Outbox Event Router look the same
(:mod:`oncely.wire`): the event id is the ``id`` header (36-character UUID text), the event type
comes from the topic's registered type (the ``eventType`` header must agree when present), and
the value is decoded by the codec. :func:`read_envelope` reads everything but the value, so that a
consumer can find the duplicates first and decode (and build models for) only the new events
with :func:`decode_events` (a batch's events of one type validated together) or
:func:`decode_event` (one, saying why it cannot be decoded).

Hostile records (random bytes, truncated or foreign Avro, non-UTF-8 or oversized headers, a
missing or malformed ``id``) become :class:`Undecodable` with the reason; a fuzz test holds
:func:`read_envelope` and :func:`decode_event` to never raising and never hanging.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from uuid import UUID

from confluent_kafka import Message

from oncely.events import EventType
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeError, DecodeFailure
from oncely.wire import EVENT_TYPE_HEADER, ID_HEADER, text_headers

#: An event id as the wire contract spells it (and PostgreSQL prints a uuid).
_CANONICAL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class Envelope:
    """A record whose headers, event id and event type are valid; its value is not decoded yet
    (a duplicate never needs it)."""

    __slots__ = ("_event_id", "event_id_text", "event_type", "headers", "message")

    def __init__(
        self,
        message: Message,
        event_id_text: str,
        event_type: EventType[Any],
        headers: dict[str, str],
    ) -> None:
        self.message = message
        self.event_id_text = event_id_text
        """The event id as canonical text: 36 lowercase characters with hyphens."""
        self.event_type = event_type
        self.headers = headers
        self._event_id: UUID | None = None

    @property
    def event_id(self) -> UUID:
        """The event id (parsed the first time it is asked for)."""
        if self._event_id is None:
            self._event_id = UUID(self.event_id_text)
        return self._event_id


class Decoded(NamedTuple):
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
    if _CANONICAL_ID.fullmatch(raw_id) is None:
        try:
            raw_id = str(UUID(raw_id))
        except ValueError:
            return Undecodable(message, f"'id' header {raw_id[:64]!r} is not a UUID")
    if message.value() is None:
        return Undecodable(message, "the record has no value (a tombstone)")
    return Envelope(message, raw_id, event_type, headers)


def decode_event(envelope: Envelope, *, codec: Codec) -> Decoded | Undecodable:
    """The event held by ``envelope``'s value, validated by its model; never raises."""
    try:
        event = codec.decode(
            envelope.message.value() or b"", envelope.headers, expected=envelope.event_type.model
        )
    except DecodeError as exc:
        return Undecodable(envelope.message, str(exc), exc.reason)
    return Decoded(envelope, event)


def decode_events(envelopes: Sequence[Envelope], *, codec: Codec) -> list[Decoded] | None:
    """The events of ``envelopes``, in order, each event type's decoded together (one model
    validation per type, :meth:`~oncely.schemas.codec.Codec.decode_many`); ``None`` when any of
    them cannot be decoded (:func:`decode_event` of each tells which, and why). Never raises."""
    by_type: dict[str, list[int]] = {}
    for index, envelope in enumerate(envelopes):
        by_type.setdefault(envelope.event_type.name, []).append(index)
    events: list[Any] = [None] * len(envelopes)
    for indexes in by_type.values():
        try:
            decoded = codec.decode_many(
                envelopes[indexes[0]].event_type,
                [envelopes[i].message.value() or b"" for i in indexes],
                [envelopes[i].headers for i in indexes],
            )
        except DecodeError:
            return None
        for index, event in zip(indexes, decoded, strict=True):
            events[index] = event
    return [Decoded(envelope, event) for envelope, event in zip(envelopes, events, strict=True)]
