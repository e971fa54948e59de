"""Outbox rows as the relay reads them, and the Kafka records they become (the record contract).

topic = row ``topic``; key = ``aggregateid`` (UTF-8); value = ``payload`` as stored; headers
``id`` and ``eventType`` first, then the row's own headers in their stored order; timestamp =
the row's ``created_at``. The relay never decodes a payload, so it needs no application code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One outbox row read by the relay; ``delayed``: its ``available_at`` is still ahead."""

    id: UUID
    seq: int
    shard: int
    topic: str
    aggregateid: str
    type: str
    payload: bytes
    headers: Mapping[str, str]
    created_at: datetime
    available_at: datetime
    delayed: bool = False

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> OutboxRow:
        return cls(
            id=row["id"],
            seq=row["seq"],
            shard=row["shard"],
            topic=row["topic"],
            aggregateid=row["aggregateid"],
            type=row["type"],
            payload=bytes(row["payload"]),
            headers=row["headers"] or {},
            created_at=row["created_at"],
            available_at=row["available_at"],
            delayed=bool(row["delayed"]),
        )

    @property
    def parking_key(self) -> tuple[str, str]:
        """What a parked key is: the topic and the Kafka key (one partition's order)."""
        return (self.topic, self.aggregateid)

    @property
    def size(self) -> int:
        """The record's bytes before compression, with a batch's overhead: what a topic's
        ``max.message.bytes`` is compared with when compression does not help."""
        headers = sum(len(name) + len(str(value)) for name, value in self.headers.items())
        return len(self.aggregateid.encode()) + len(self.payload) + headers + 36 + 128

    @property
    def key(self) -> bytes:
        return self.aggregateid.encode()

    @property
    def timestamp_ms(self) -> int:
        return int(self.created_at.timestamp() * 1000)

    def kafka_headers(self) -> list[tuple[str, str | bytes | None]]:
        """``id`` (36 lowercase characters, as Debezium sends it), ``eventType``, then extras."""
        headers: list[tuple[str, str | bytes | None]] = [
            ("id", str(self.id).encode()),
            ("eventType", self.type.encode()),
        ]
        headers.extend((name, str(value).encode()) for name, value in self.headers.items())
        return headers
