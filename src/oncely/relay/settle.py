"""What the delivery reports of the pages in flight settle (pure logic over the shards' pages).

A page is acknowledged when every record of it has a successful report; a shard's progress
moves to the end of its last acknowledged page at the front. A shard whose oldest page has a
failure, or whose reports are overdue (``delivery_timeout_ms``), must replay; the loop decides
how (:mod:`oncely.relay.failures`) and records what is acknowledged first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

from oncely import wire
from oncely.relay.shards import Failure, Page, Shard
from oncely.storage.stores.outbox.relay import Held, Parking, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow


@dataclass(slots=True)
class Settled:
    """The pages acknowledged since the last call and what they move; the shards to replay."""

    #: Acknowledged pages (their rows are published: count them).
    acknowledged: list[Page] = field(default_factory=list)
    #: Each shard's new position.
    progress: list[ShardProgress] = field(default_factory=list)
    #: Keys parked and rows held by the acknowledged pages, recorded with the progress.
    parked: dict[tuple[str, str], tuple[Parking, int]] = field(default_factory=dict)
    held: list[Held] = field(default_factory=list)
    #: Shards whose oldest page failed, with the failure.
    failed: dict[int, Failure] = field(default_factory=dict)
    #: Oldest pages whose reports are overdue.
    overdue: list[Page] = field(default_factory=list)


def take_errors(shards: Iterable[Shard]) -> list[tuple[OutboxRow, KafkaError]]:
    """The failed reports of every page, each with its row (matched by the ``id`` header); each
    page's first one becomes its failure."""
    seen: list[tuple[OutboxRow, KafkaError]] = []
    for shard in shards:
        for page in shard.pages:
            if not page.errors:
                continue
            by_id = {row.event_id.encode(): row for row in page.produced}
            for error, message in page.errors:
                headers = dict(message.headers() or []) if message is not None else {}
                event_id = headers.get(wire.ID_HEADER)
                row = (by_id.get(event_id) if isinstance(event_id, bytes) else None) or (
                    page.produced[-1]
                )
                seen.append((row, error))
                if page.failure is None:
                    page.failure = Failure(row, error, own=page.isolated)
            page.errors.clear()
    return seen


def settle(shards: Iterable[Shard], now: float) -> Settled:
    """Take the acknowledged pages off the front of each shard; find the failed and overdue."""
    settled = Settled()
    for shard in shards:
        acknowledged = shard.take_acknowledged() if shard.pages else None
        if acknowledged:
            settled.acknowledged.extend(acknowledged)
            for page in acknowledged:
                if page.parked:
                    settled.parked.update({p.key: (p, shard.epoch) for p in page.parked})
                if page.held:
                    settled.held.extend(page.held)
            last = acknowledged[-1]
            settled.progress.append(ShardProgress(shard.shard, shard.epoch, last.ends))
        if shard.pages:
            first = shard.pages[0]
            if first.failure is not None and first.failed:
                settled.failed[shard.shard] = first.failure
            elif first.outstanding and now >= first.deadline:
                settled.overdue.append(first)
    return settled
