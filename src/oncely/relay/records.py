"""Claimed outbox rows and the Kafka records they become (the brief's record contract).

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
class ClaimedRow:
    """One outbox row leased by this relay; ``attempts`` is the fencing token of the lease."""

    id: UUID
    seq: int
    topic: str
    aggregateid: str
    type: str
    payload: bytes
    headers: Mapping[str, str]
    attempts: int
    created_at: datetime

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> ClaimedRow:
        return cls(
            id=row["id"],
            seq=row["seq"],
            topic=row["topic"],
            aggregateid=row["aggregateid"],
            type=row["type"],
            payload=bytes(row["payload"]),
            headers=row["headers"] or {},
            attempts=row["attempts"],
            created_at=row["created_at"],
        )

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
