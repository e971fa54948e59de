"""Outbox rows as the relay reads them, and the Kafka records they become (:mod:`oncely.wire`).

The relay never decodes a payload, so it needs no application code.

The statements that read rows to publish (``relay_read``, ``relay_rows``, ``republish_rows``)
select the same columns (outbox.sql's ``row_to_publish``, then the row's delay): ``created_at``
(in microseconds) and the headers' text come from PostgreSQL, so each row costs one constructor
call here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from oncely.wire import (
    Headers,
    cloudevents_headers,
    record_headers,
    row_headers,
    trace_context_fields,
)


@dataclass(slots=True, eq=False)
class OutboxRow:
    """One outbox row read by the relay (not frozen only because that makes it cheaper to make).

    ``event_id``: the row's ``id`` as text; ``created_us``: ``created_at`` in microseconds
    since the epoch; ``available_at``: set only while it is still ahead (the row is delayed
    until then); ``trace_context``: the ``tracingspancontext`` staged with the row.
    """

    event_id: str
    seq: int
    shard: int
    topic: str
    aggregateid: str
    type: str
    payload: bytes
    headers: Headers
    created_us: int
    available_at: datetime | None = None
    trace_context: str | None = None

    @classmethod
    def of(cls, columns: Sequence[Any]) -> OutboxRow:
        """The row from a statement's columns (``headers`` as ``jsonb`` text)."""
        event_id, seq, shard, topic, key, type_, payload, headers, us, trace, available_at = columns
        return cls(
            event_id,
            seq,
            shard,
            topic,
            key,
            type_,
            bytes(payload),
            row_headers(headers) if headers else (),
            us,
            available_at,
            trace,
        )

    @property
    def timestamp_ms(self) -> int:
        """The record's timestamp: ``created_at`` in whole milliseconds, rounded down."""
        return self.created_us // 1000

    @property
    def id(self) -> UUID:
        return UUID(self.event_id)

    @property
    def delayed(self) -> bool:
        return self.available_at is not None

    @property
    def parking_key(self) -> tuple[str, str]:
        """What a parked key is: the topic and the Kafka key (one partition's order)."""
        return (self.topic, self.aggregateid)

    @property
    def size(self) -> int:
        """The record's bytes before compression, with a batch's overhead: what a topic's
        ``max.message.bytes`` is compared with when compression does not help."""
        headers = sum(len(name) + len(value) for name, value in self.headers)
        return len(self.aggregateid.encode()) + len(self.payload) + headers + 36 + 128

    @property
    def key(self) -> bytes:
        return self.aggregateid.encode()

    def kafka_headers(
        self, *, trace: Headers | None = None, cloudevents_source: str | None = None
    ) -> list[tuple[str, str | bytes | None]]:
        """The record's headers (:func:`oncely.wire.record_headers`): ``id`` (36 lowercase
        characters, as Debezium sends it), ``eventType``, the row's own, the trace context
        (``trace``, default: the staged one), the CloudEvents headers with
        ``cloudevents_source``."""
        if trace is None:
            trace = _encoded(trace_context_fields(self.trace_context)) if self.trace_context else ()
        cloudevents = (
            cloudevents_headers(self.event_id, self.type, self.created_us, cloudevents_source)
            if cloudevents_source
            else ()
        )
        return record_headers(self.event_id, self.type, self.headers, trace, cloudevents)


def _encoded(fields: Mapping[str, str]) -> Headers:
    return tuple((name, value.encode()) for name, value in fields.items())


@dataclass(frozen=True, slots=True)
class TopicPurge:
    """The rows of one topic a purge deletes (or would), and the oldest of them."""

    topic: str
    rows: int
    oldest_id: UUID
    oldest_created_at: datetime
