"""Exactly-once producing's Kafka side (:mod:`oncely.relay.transactions`) on the real broker:
a page committed with its progress record is visible to ``read_committed`` readers and its
progress reads back; taking a shard fences its previous owner, even a paused one, whose open
transaction is never visible; a transaction the broker refuses a record of is aborted whole.
And PostgreSQL's snapshots order as taken (how a takeover finds the position ahead)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError, KafkaException, Message
from prometheus_client import CollectorRegistry

from oncely.relay import service
from oncely.relay.meters import Meters
from oncely.relay.publisher import Publisher, TransactionalPublisher
from oncely.relay.service import producer_config
from oncely.relay.transactions import Transactions
from oncely.runtime.metrics import RelayMetrics
from oncely.settings import KafkaSettings, RelaySettings
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
from oncely.wire import ProgressRecord, progress_topic
from tests.helpers.kafka import read_committed


@pytest.fixture
def transactions(
    kafka_bootstrap: str, progress_prefix: str
) -> Iterator[Callable[[], Transactions]]:
    """``transactions()``: a new owner of the prefix's transactional ids (as another relay
    process would be); each closed after the test."""
    made: list[Transactions] = []

    def make() -> Transactions:
        made.append(
            Transactions(
                {"bootstrap.servers": kafka_bootstrap, "linger.ms": 5},
                client={"bootstrap.servers": kafka_bootstrap},
                prefix=progress_prefix,
                transaction_timeout_ms=30_000,
                timeout=10,
            )
        )
        return made[-1]

    yield make
    for owner in made:
        owner.close()


class Reports:
    """The reports of one page: each record's, then the commit's (message ``None``)."""

    def __init__(self) -> None:
        self.errors: list[KafkaError | None] = []
        self.committed: KafkaError | bool | None = False

    def record(self, error: KafkaError | None, message: Message | None) -> None:
        self.errors.append(error)

    def commit(self, error: KafkaError | None, message: Message | None) -> None:
        self.committed = error if error is not None else True

    def wait(self, owner: Transactions, timeout: float = 20) -> KafkaError | bool:
        deadline = time.monotonic() + timeout
        while self.committed is False and time.monotonic() < deadline:
            owner.poll(0.1)
        assert self.committed is not False, "no commit report"
        assert self.committed is not None
        return self.committed


def send(
    owner: Transactions, shard: int, topic: str, values: list[bytes], reports: Reports
) -> None:
    producer = owner.producer(shard)
    for value in values:
        producer.produce(topic, value, b"key", on_delivery=owner.report(reports.record))


def position(shard: int, epoch: int, after_seq: int) -> ProgressRecord:
    return ProgressRecord(shard, epoch, "100:100:", "100:110:", after_seq)


def test_a_committed_page_is_read_committed_and_its_progress_reads_back(
    transactions: Callable[[], Transactions], new_topic: Callable[..., str], kafka_bootstrap: str
) -> None:
    topic = new_topic()
    owner = transactions()
    assert owner.take([3]) == {}
    reports = Reports()
    send(owner, 3, topic, [b"a", b"b", b"c"], reports)
    owner.commit(3, position(3, 1, 42), reports.commit)
    assert reports.wait(owner) is True
    assert reports.errors == [None, None, None]
    assert [r.value for r in read_committed(kafka_bootstrap, [topic])] == [b"a", b"b", b"c"]
    assert owner.lost() == set()

    taking_over = transactions()
    assert taking_over.take([3, 4]) == {3: position(3, 1, 42)}


def test_the_read_back_waits_past_another_shards_open_transaction_for_a_later_commit(
    transactions: Callable[[], Transactions], progress_prefix: str
) -> None:
    committing, stalled = transactions(), transactions()
    committing.take([9])
    stalled.take([8])
    open_one = stalled.producer(8)  # a transaction left open on the progress topic, first
    open_one.produce(progress_topic(progress_prefix), position(8, 1, 1).value(), b"8")
    assert open_one.flush(10) == 0
    reports = Reports()
    committing.commit(9, position(9, 1, 5), reports.commit)  # committed behind it
    assert reports.wait(committing) is True

    threading.Timer(1.0, open_one.abort_transaction, args=(10,)).start()
    assert transactions().take([9]) == {9: position(9, 1, 5)}


@pytest.mark.parametrize(
    ("taking", "named"),
    [
        (9, "stays open \\(shard 8's, from offset 0\\)\""),
        (
            8,
            "stays open \\(shard 8's, from offset 0, though this relay's producer of the shard "
            "has no transaction open: the broker left it hanging, see "
            "docs/how-to/deploy.md#a-hanging-transaction",
        ),
    ],
    ids=["another-shard", "a-shard-taken"],
)
def test_a_read_back_held_past_its_timeout_names_the_shard_whose_transaction_stays_open(
    transactions: Callable[[], Transactions],
    kafka_bootstrap: str,
    progress_prefix: str,
    taking: int,
    named: str,
) -> None:
    """A transaction of a shard being taken stays open only if the broker left it hanging (a
    healthy broker ends it when the new producer fences the old): its record is staged here
    under shard 8's key by the producer of another transactional id."""
    stalled = transactions()
    stalled.take([7 if taking == 8 else 8])
    open_one = stalled.producer(7 if taking == 8 else 8)
    open_one.produce(progress_topic(progress_prefix), position(8, 1, 1).value(), b"8")
    assert open_one.flush(10) == 0
    impatient = Transactions(
        {"bootstrap.servers": kafka_bootstrap},
        client={"bootstrap.servers": kafka_bootstrap},
        prefix=progress_prefix,
        transaction_timeout_ms=30_000,
        timeout=2,
    )
    try:
        with pytest.raises(KafkaException, match=named):
            impatient.take([taking])
        assert impatient.held() == []  # given back
    finally:
        impatient.close()
        open_one.abort_transaction(10)


def test_taking_a_shard_fences_its_paused_owner_whose_open_transaction_never_shows(
    transactions: Callable[[], Transactions], new_topic: Callable[..., str], kafka_bootstrap: str
) -> None:
    topic = new_topic()
    paused, taking_over = transactions(), transactions()
    paused.take([5])
    before = Reports()
    send(paused, 5, topic, [b"before"], before)
    paused.commit(5, position(5, 1, 1), before.commit)
    assert before.wait(paused) is True

    stale = Reports()
    send(paused, 5, topic, [b"stale-1", b"stale-2"], stale)
    assert paused.producer(5).flush(10) == 0  # on the broker, in a transaction left open
    on_the_broker = read_committed(kafka_bootstrap, [topic], committed=False)
    assert [r.value for r in on_the_broker] == [b"before", b"stale-1", b"stale-2"]

    assert taking_over.take([5]) == {5: position(5, 1, 1)}
    after = Reports()
    send(taking_over, 5, topic, [b"after"], after)
    taking_over.commit(5, position(5, 2, 2), after.commit)
    assert after.wait(taking_over) is True

    paused.commit(5, position(5, 1, 3), stale.commit)  # resumed: it cannot commit
    error = stale.wait(paused)
    assert isinstance(error, KafkaError)
    assert paused.lost() == {5}
    assert [r.value for r in read_committed(kafka_bootstrap, [topic])] == [b"before", b"after"]
    assert transactions().take([5]) == {5: position(5, 2, 2)}


def test_a_transaction_with_a_record_the_broker_refuses_is_aborted_whole(
    transactions: Callable[[], Transactions], new_topic: Callable[..., str], kafka_bootstrap: str
) -> None:
    topic = new_topic(config={"max.message.bytes": "2000"})
    owner = transactions()
    owner.take([7])
    first = Reports()
    send(owner, 7, topic, [b"first"], first)
    owner.commit(7, position(7, 1, 1), first.commit)
    assert first.wait(owner) is True

    refused = Reports()
    send(owner, 7, topic, [b"fits", b"x" * 10_000, b"fits too"], refused)
    owner.commit(7, position(7, 1, 4), refused.commit)
    error = refused.wait(owner)
    assert isinstance(error, KafkaError)
    assert any(e is not None and e.code() == KafkaError.MSG_SIZE_TOO_LARGE for e in refused.errors)
    assert owner.lost() == set()  # aborted: the producer goes on

    again = Reports()
    send(owner, 7, topic, [b"fits"], again)
    owner.commit(7, position(7, 1, 2), again.commit)
    assert again.wait(owner) is True
    assert [r.value for r in read_committed(kafka_bootstrap, [topic])] == [b"first", b"fits"]
    assert transactions().take([7]) == {7: position(7, 1, 2)}


def test_the_meters_count_a_commit_and_a_fenced_producer_and_time_each_transaction(
    transactions: Callable[[], Transactions], new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    registry = CollectorRegistry()
    meters = Meters(RelayMetrics(registry), None, exactly_once=True)

    def count(outcome: str) -> float | None:
        return registry.get_sample_value("oncely_relay_transactions_total", {"outcome": outcome})

    paused, taking_over = transactions(), transactions()
    paused.take([6])
    committed = Reports()
    send(paused, 6, topic, [b"a", b"b"], committed)
    paused.commit(6, position(6, 1, 2), committed.commit)
    assert committed.wait(paused) is True
    meters.transactions(paused.ended())
    assert count("committed") == 1
    assert registry.get_sample_value("oncely_relay_transaction_seconds_count") == 1

    stale = Reports()
    send(paused, 6, topic, [b"stale"], stale)
    assert paused.producer(6).flush(10) == 0
    taking_over.take([6])  # fences the paused producer
    paused.commit(6, position(6, 1, 3), stale.commit)
    assert isinstance(stale.wait(paused), KafkaError)
    meters.transactions(paused.ended())
    assert (count("committed"), count("fenced"), count("aborted"), count("failed")) == (1, 1, 0, 0)
    assert registry.get_sample_value("oncely_relay_transaction_seconds_count") == 2
    assert paused.ended() == []  # each is reported once


def test_snapshots_order_as_postgresql_took_them(engine: sa.Engine) -> None:
    """The order a takeover compares positions by (:meth:`Snapshot.order`) follows time,
    with transactions starting and ending between snapshots."""

    def snapshot() -> Snapshot:
        with engine.connect() as conn:
            return Snapshot.parse(
                conn.execute(sa.text("SELECT pg_current_snapshot()::text")).scalar_one()
            )

    taken = [snapshot()]
    with engine.connect() as first, engine.connect() as second:
        first.execute(sa.text("SELECT pg_current_xact_id()"))
        taken.append(snapshot())
        second.execute(sa.text("SELECT pg_current_xact_id()"))
        taken.append(snapshot())
        first.commit()
        taken.append(snapshot())
        with engine.begin() as third:
            third.execute(sa.text("SELECT pg_current_xact_id()"))
        taken.append(snapshot())
        second.rollback()
        taken.append(snapshot())
    assert len(set(taken)) >= 4
    for earlier, later in itertools.pairwise(taken):
        assert earlier.order() < later.order() or earlier == later


def test_the_transactional_publisher_sends_a_page_as_the_publisher_does_visible_once_committed(
    progress_prefix: str, new_topic: Callable[..., str], kafka_bootstrap: str
) -> None:
    topic = new_topic(partitions=3)
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    relay = RelaySettings(exactly_once=True, transactional_id_prefix=progress_prefix)
    config, client = producer_config(kafka, relay), kafka.client_config()
    owner = service.transactions(config, kafka, relay)  # as the relay process makes them
    publisher = TransactionalPublisher(config, client=client, transactions=owner)
    plain = Publisher(config, client=client)
    try:
        assert publisher.take([2]) == {}
        rows = [
            OutboxRow(str(uuid.uuid4()), seq, 2, topic, f"key-{seq % 2}", "t", b"v%d" % seq, (), 0)
            for seq in range(1, 6)
        ]
        reports = Reports()
        for row in rows:
            assert publisher.produce(row, reports.record) is None
        done = Progress(Snapshot.parse("10:10:"), Snapshot.parse("10:12:"), 5)
        assert publisher.commit(ShardProgress(2, 3, done), reports.commit)
        assert publisher.flush(20) == 0
        assert reports.committed is True
        assert reports.errors == [None] * 5

        expected = Reports()
        twin = new_topic(partitions=3)
        for row in rows:
            plain.produce(dataclasses.replace(row, topic=twin), expected.record)
        assert plain.flush(20) == 0
        assert plain.commit(ShardProgress(2, 3, done), expected.commit) is False
        seen = read_committed(kafka_bootstrap, [topic])
        same = read_committed(kafka_bootstrap, [twin])
        assert sorted((r.partition, r.offset, r.key, r.value, r.headers) for r in seen) == sorted(
            (r.partition, r.offset, r.key, r.value, r.headers) for r in same
        )
    finally:
        owner.close()
    taking_over = service.transactions(config, kafka, relay)
    try:
        assert TransactionalPublisher(config, client=client, transactions=taking_over).take(
            [2]
        ) == {2: done}
    finally:
        taking_over.close()


def test_a_release_stays_in_its_shards_progress_records_until_it_is_unparked(
    progress_prefix: str, kafka_bootstrap: str
) -> None:
    """A committed release's parked row is in every later progress record of its shard, so a
    next owner reads it back, until PostgreSQL recorded the key unparked; an aborted one never
    is."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    relay = RelaySettings(exactly_once=True, transactional_id_prefix=progress_prefix)
    config, client = producer_config(kafka, relay), kafka.client_config()
    parked, aborted = uuid.uuid4(), uuid.uuid4()
    at = ShardProgress(4, 1, Progress(Snapshot.parse("10:10:")))

    def next_owner() -> frozenset[uuid.UUID]:
        owner = service.transactions(config, kafka, relay)
        try:
            publisher = TransactionalPublisher(config, client=client, transactions=owner)
            publisher.take([4])
            return publisher.released(4)
        finally:
            owner.close()

    def commit(publisher: TransactionalPublisher, **kwargs: object) -> None:
        reports = Reports()
        assert publisher.commit(at, reports.commit, **kwargs)  # type: ignore[arg-type]
        assert publisher.flush(20) == 0
        assert reports.committed is True

    owner = service.transactions(config, kafka, relay)
    publisher = TransactionalPublisher(config, client=client, transactions=owner)
    try:
        publisher.take([4])
        commit(publisher, releasing=[parked])
        commit(publisher, abort=True, releasing=[aborted])
        assert publisher.released(4) == {parked}
        commit(publisher)  # a later page
    finally:
        owner.close()
    assert next_owner() == {parked}

    owner = service.transactions(config, kafka, relay)
    publisher = TransactionalPublisher(config, client=client, transactions=owner)
    try:
        publisher.take([4])
        publisher.unparked(4, parked)
        commit(publisher)
    finally:
        owner.close()
    assert next_owner() == frozenset()
