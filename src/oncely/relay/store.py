"""The relay's only access to PostgreSQL: claim, settle, release and purge outbox rows.

Every method is one named statement (``storage/sql/outbox.sql``) in its own short transaction.
Settles are fenced by ``lease_owner`` and ``attempts``: a row the store does not return as
settled was re-claimed by another relay after this relay's lease expired (``lease_lost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.ops.failpoints import failpoint
from oncely.relay.records import ClaimedRow
from oncely.storage.queries import query


@dataclass(frozen=True, slots=True)
class Published:
    row: ClaimedRow
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Failed:
    row: ClaimedRow
    delay_seconds: float
    error: str
    dead: bool


@dataclass(frozen=True, slots=True)
class SettleResult:
    settled: int
    lease_lost: list[UUID]
    dead: list[UUID]


@dataclass(frozen=True, slots=True)
class TopicBacklog:
    topic: str
    pending: int
    dead: int
    oldest_pending_seconds: float


@dataclass(frozen=True, slots=True)
class TopicPurge:
    """The published rows of one topic a purge would delete, and the oldest of them."""

    topic: str
    rows: int
    oldest_id: UUID
    oldest_published_at: datetime


class OutboxStore:
    """Outbox statements for the relay ``owner`` over a SQLAlchemy ``Engine``."""

    def __init__(self, engine: sa.Engine, *, owner: str) -> None:
        self.engine = engine
        self.owner = owner

    def claim(self, *, batch_size: int, lease_seconds: float) -> list[ClaimedRow]:
        """Lease up to ``batch_size`` due rows, at most one per key, oldest first."""
        with self.engine.begin() as conn:
            rows = conn.execute(
                query("outbox_claim"),
                {"owner": self.owner, "batch_size": batch_size, "lease_seconds": lease_seconds},
            ).mappings()
            claimed = [ClaimedRow.from_mapping(dict(row)) for row in rows]
        claimed.sort(key=lambda row: row.seq)
        return claimed

    def mark_published(self, published: Sequence[Published], *, delete: bool) -> SettleResult:
        """Settle confirmed rows (or delete them when ``delete``); fenced."""
        if not published:
            return SettleResult(0, [], [])
        params: dict[str, object] = {
            "owner": self.owner,
            "ids": [p.row.id for p in published],
            "attempts": [p.row.attempts for p in published],
        }
        if delete:
            statement = query("outbox_delete_published")
        else:
            statement = query("outbox_mark_published")
            params["partitions"] = [p.partition for p in published]
            params["offsets"] = [p.offset for p in published]
        with self.engine.begin() as conn:
            done = set(conn.execute(statement, params).scalars())
            failpoint("relay.after_mark_before_commit")
        lost = [p.row.id for p in published if p.row.id not in done]
        return SettleResult(len(done), lost, [])

    def mark_failed(self, failed: Sequence[Failed]) -> SettleResult:
        """Settle failed rows: back to pending after their delay, or dead; fenced."""
        if not failed:
            return SettleResult(0, [], [])
        with self.engine.begin() as conn:
            rows = conn.execute(
                query("outbox_mark_failed"),
                {
                    "owner": self.owner,
                    "ids": [f.row.id for f in failed],
                    "attempts": [f.row.attempts for f in failed],
                    "delays": [f.delay_seconds for f in failed],
                    "errors": [f.error for f in failed],
                    "dead": [f.dead for f in failed],
                },
            ).all()
        done = {row.id for row in rows}
        dead = [row.id for row in rows if row.status == "dead"]
        lost = [f.row.id for f in failed if f.row.id not in done]
        return SettleResult(len(done), lost, dead)

    def release(self, rows: Sequence[ClaimedRow]) -> int:
        """Give back leases held without a result; the rows are due again at once."""
        if not rows:
            return 0
        with self.engine.begin() as conn:
            released = conn.execute(
                query("outbox_release"), {"owner": self.owner, "ids": [r.id for r in rows]}
            ).all()
        return len(released)

    def purge(self, *, older_than_seconds: float, batch_size: int = 5000) -> int:
        """Delete published rows older than the horizon, in batches; return how many."""
        total = 0
        while True:
            with self.engine.begin() as conn:
                deleted = conn.execute(
                    query("outbox_purge"),
                    {"older_than": older_than_seconds, "batch_size": batch_size},
                ).rowcount
            total += deleted
            if deleted < batch_size:
                return total

    def purge_preview(self, *, older_than_seconds: float) -> list[TopicPurge]:
        """What :meth:`purge` would delete now, per topic; changes nothing."""
        with self.engine.connect() as conn:
            rows = conn.execute(query("outbox_purge_preview"), {"older_than": older_than_seconds})
            return [TopicPurge(r.topic, r.rows, r.oldest_id, r.oldest_published_at) for r in rows]

    def backlog(self) -> list[TopicBacklog]:
        """Per topic: pending depth, dead count and the oldest pending row's age."""
        with self.engine.connect() as conn:
            rows = conn.execute(query("outbox_backlog")).all()
        return [
            TopicBacklog(row.topic, row.pending, row.dead, float(row.oldest_pending_seconds))
            for row in rows
        ]
