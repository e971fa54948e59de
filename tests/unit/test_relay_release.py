"""Publishing released keys' rows, and what a failed release leaves parked (store and publisher
fakes)."""

from __future__ import annotations

from confluent_kafka import KafkaError

from oncely.relay.release import ParkAgain, Unpark, park_again, release
from oncely.relay.topics import TopicState
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, ShardProgress
from oncely.storage.stores.outbox.snapshots import Snapshot
from tests.unit.relay_fakes import Clock, FakePublisher, FakeStore

POSITION = ShardProgress(0, 1, Progress(Snapshot(1, 1, frozenset())))


def _parked(store: FakeStore, key: str, *, held: int) -> tuple[Parking, list[str]]:
    store.acquire(wanted=len(store.leases), lease_seconds=10)
    dead = store.stage(0, key)
    later = [store.stage(0, key) for _ in range(held)]
    parking = Parking("orders", key, 0, dead.id, "dead", request="requeue")
    store.record(
        [ShardProgress(0, 1, store.leases[0].progress)],
        parked=[(parking, 1)],
        held=[Held(r.id, r.topic, r.aggregateid, r.shard) for r in later],
    )
    return parking, [dead.event_id, *(r.event_id for r in later)]


def test_a_released_key_publishes_its_row_then_its_held_rows_in_order() -> None:
    clock = Clock()
    store, publisher = FakeStore(shards=1), FakePublisher(clock)
    parking, ids = _parked(store, "a", held=2)
    outcome = release(store, publisher, [parking], position=POSITION, timeout=1.0, clock=clock)
    assert [r.event_id for r in publisher.sent] == ids
    assert outcome.again == [] and not outcome.failed
    assert outcome.unpark == [Unpark(parking, outcome.unpark[0].rows, 2)]


def test_a_skipped_key_publishes_only_its_held_rows() -> None:
    clock = Clock()
    store, publisher = FakeStore(shards=1), FakePublisher(clock)
    parking, ids = _parked(store, "a", held=1)
    skip = Parking("orders", "a", 0, parking.event_id, "dead", request="skip")
    release(store, publisher, [skip], position=POSITION, timeout=1.0, clock=clock)
    assert [r.event_id for r in publisher.sent] == ids[1:]


def test_a_key_whose_rows_fail_stays_parked_and_the_shard_backs_off() -> None:
    clock = Clock()
    store, publisher = FakeStore(shards=1), FakePublisher(clock)
    parking, ids = _parked(store, "a", held=1)
    publisher.failing[ids[0]] = KafkaError.INVALID_RECORD
    outcome = release(store, publisher, [parking], position=POSITION, timeout=1.0, clock=clock)
    assert outcome.failed and outcome.unpark == []
    assert outcome.again[0].dead is not None and outcome.again[0].block is None


def test_parking_again_blocks_a_missing_topic_and_deads_only_the_keys_own_row() -> None:
    store = FakeStore(shards=1)
    own = store.stage(0, "a")
    held = store.stage(0, "a")
    missing = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    invalid = KafkaError(KafkaError.INVALID_RECORD)
    blocked = Parking("orders", "a", 0, own.id, "blocked")
    dead = Parking("orders", "a", 0, own.id, "dead")
    assert park_again(blocked, own, missing) == ParkAgain(
        blocked, block=("orders", TopicState.MISSING)
    )
    assert park_again(dead, held, invalid) == ParkAgain(dead)
    assert park_again(dead, own, KafkaError(KafkaError._MSG_TIMED_OUT)) == ParkAgain(dead)
    assert park_again(dead, own, invalid).dead is not None


def test_a_key_a_committed_transaction_released_is_unparked_without_publishing_again() -> None:
    """Exactly once, a relay that died between a release's Kafka commit and its unparking in
    PostgreSQL left the parking's event id in the shard's progress record: the next owner
    unparks the key and publishes none of its rows again, and the other keys as usual."""
    clock = Clock()
    store, publisher = FakeStore(shards=1), FakePublisher(clock)
    done, _ = _parked(store, "a", held=2)
    parking, ids = _parked(store, "b", held=1)
    publisher.releases[0] = {done.event_id}
    outcome = release(
        store, publisher, [done, parking], position=POSITION, timeout=1.0, clock=clock
    )
    assert [r.event_id for r in publisher.sent] == ids, "only the key not released before"
    assert outcome.unpark == [Unpark(done, [], 2), Unpark(parking, outcome.unpark[1].rows, 3)]
    assert not outcome.failed
