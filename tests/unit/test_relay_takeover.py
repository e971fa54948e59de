"""Taking shards in Kafka too (exactly-once mode), on fakes: a shard starts where Kafka has it
when that is ahead of its recorded progress (recorded first), else where it was recorded; a
broker that does not answer gives every shard back; a lease lost while its producer started is
dropped."""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException

from oncely.relay import takeover
from oncely.relay.ports import Sources
from oncely.relay.topics import TopicWatch
from oncely.runtime.retry import Backoff
from oncely.settings import RelaySettings
from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.snapshots import Snapshot
from tests.unit.relay_fakes import Clock, FakePublisher, FakeStore, guard

BEHIND = Progress(Snapshot(1, 1, frozenset()))
AHEAD = Progress(Snapshot(5, 7, frozenset({6})), Snapshot(7, 9, frozenset()), 40)


class InKafka(FakePublisher):
    """A publisher whose Kafka has ``positions``, or does not answer (``answers=False``)."""

    def __init__(self, positions: dict[int, Progress], *, answers: bool = True) -> None:
        super().__init__(Clock())
        self.positions, self.answers = positions, answers
        self.dropped: list[int] = []

    def take(self, shards: Iterable[int]) -> dict[int, Progress]:
        if not self.answers:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return {n: p for n, p in self.positions.items() if n in set(shards)}

    def drop(self, shard: int) -> None:
        self.dropped.append(shard)


def sources(store: FakeStore, publisher: InKafka) -> Sources:
    watch = TopicWatch(
        probe=publisher.topic_state, backoff=Backoff(first=1, maximum=1), clock=Clock()
    )
    return Sources(store, publisher, watch, RelaySettings(lease_seconds=3))


def test_a_shard_starts_where_kafka_has_it_when_that_is_ahead_recorded_first() -> None:
    store = FakeStore(shards=3)
    store.leases[1].progress = AHEAD  # recorded further than Kafka has it (a quiet record)
    leases = store.acquire(wanted=3, lease_seconds=3)
    publisher = InKafka({0: AHEAD, 1: BEHIND})
    taken = takeover.in_kafka(sources(store, publisher), leases, db=guard)
    assert [(t.shard, t.progress) for t in taken] == [(0, AHEAD), (1, AHEAD), (2, BEHIND)]
    assert store.leases[0].progress == AHEAD  # recorded before the shard is read


def test_a_broker_that_does_not_answer_gives_every_shard_back() -> None:
    store = FakeStore(shards=2)
    leases = store.acquire(wanted=2, lease_seconds=3)
    assert takeover.in_kafka(sources(store, InKafka({}, answers=False)), leases, db=guard) == []
    assert {lease.owner for lease in store.leases.values()} == {None}


def test_a_lease_lost_while_its_producer_started_is_dropped() -> None:
    store = FakeStore(shards=2)
    leases = store.acquire(wanted=2, lease_seconds=3)
    store.leases[1].epoch += 1  # taken over meanwhile
    publisher = InKafka({})
    kept = takeover.renew(sources(store, publisher), leases, held=[], asleep=False, db=guard)
    assert [lease.shard for lease in kept] == [0]
    assert publisher.dropped == [1]
