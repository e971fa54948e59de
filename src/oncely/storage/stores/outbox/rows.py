"""Outbox rows as the relay reads them, and the Kafka records they become (:mod:`oncely.wire`).

The relay never decodes a payload, so it needs no application code.

The statements that read rows to publish (``relay_read``, ``relay_rows``, ``republish_rows``)
select the same columns, in :class:`OutboxRow`'s field order: the timestamp and the headers' text
come from PostgreSQL, so each row costs one constructor call here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from oncely.wire import Headers, record_headers, row_headers


@dataclass(slots=True, eq=False)
class OutboxRow:
    """One outbox row read by the relay (not frozen only because that makes it cheaper to make).

    ``event_id``: the row's ``id`` as text; ``available_at``: set only while it is still ahead
    (the row is delayed until then).
    """

    event_id: str
    seq: int
    shard: int
    topic: str
    aggregateid: str
    type: str
    payload: bytes
    headers: Headers
    timestamp_ms: int
    available_at: datetime | None = None

    @classmethod
    def of(cls, columns: Sequence[Any]) -> OutboxRow:
        """The row from a statement's columns (``headers`` as ``jsonb`` text)."""
        event_id, seq, shard, topic, key, type_, payload, headers, ms, available_at = columns
        return cls(
            event_id,
            seq,
            shard,
            topic,
            key,
            type_,
            bytes(payload),
            row_headers(headers) if headers else (),
            ms,
            available_at,
        )

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

    def kafka_headers(self) -> list[tuple[str, str | bytes | None]]:
        """``id`` (36 lowercase characters, as Debezium sends it), ``eventType``, then extras."""
        return record_headers(self.event_id, self.type, self.headers)


@dataclass(frozen=True, slots=True)
class TopicPurge:
    """The rows of one topic a purge deletes (or would), and the oldest of them."""

    topic: str
    rows: int
    oldest_id: UUID
    oldest_created_at: datetime
