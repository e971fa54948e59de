"""When progress is recorded, and what a refused write leaves to record (pure)."""

from __future__ import annotations

import uuid

from oncely.relay.progress import Acknowledged, Refused, quiet, refused
from oncely.relay.shards import Shard
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, ShardProgress
from oncely.storage.stores.outbox.snapshots import Snapshot

A = Progress(Snapshot(1, 1, frozenset()))
B = Progress(Snapshot(9, 9, frozenset()))


def test_progress_is_recorded_at_most_every_interval_unless_urgent() -> None:
    acknowledged = Acknowledged(interval=0.02)
    assert not acknowledged.due(0.0, urgent=True)  # nothing waits
    acknowledged.add(ShardProgress(0, 1, A))
    assert acknowledged.due(0.0, urgent=False)
    assert acknowledged.take(0.0) == [ShardProgress(0, 1, A)]
    acknowledged.add(ShardProgress(0, 1, B))
    acknowledged.add(ShardProgress(1, 1, A))
    assert not acknowledged.due(0.01, urgent=False)
    assert acknowledged.due(0.01, urgent=True)
    assert abs(acknowledged.wait(0.01) - 0.01) < 1e-9
    assert acknowledged.due(0.02, urgent=False)
    acknowledged.drop(1)
    assert acknowledged.take(0.02) == [ShardProgress(0, 1, B)]
    assert acknowledged.wait(0.02) == float("inf")


def test_quiet_shards_are_those_read_past_their_record_with_nothing_in_flight() -> None:
    moved = Shard(0, 1, A, B, 10.0)
    still = Shard(1, 1, A, A, 10.0)
    assert quiet([moved, still]) == [ShardProgress(0, 1, B)]


def test_a_refused_write_leaves_the_other_shards_to_record() -> None:
    parking = Parking("t", "k", 1, uuid.uuid4(), "dead")
    held = Held(uuid.uuid4(), "t", "k", 1)
    progress = [ShardProgress(0, 1, A), ShardProgress(1, 1, A)]
    assert refused(progress, [(parking, 1)], [held], recorded={0, 1}) is None
    assert refused(progress, [(parking, 1)], [held], recorded={0}) == Refused(
        frozenset({1}), [ShardProgress(0, 1, A)], [], []
    )
