"""The relay against real Kafka and PostgreSQL: every committed row once, in per-key order.

Rows are read by snapshot difference per leased shard; progress is per page and fenced.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from oncely.relay import Relay
from oncely.relay.service import session_options
from oncely.relay.signals import Signal
from oncely.storage import outbox
from oncely.storage.stores.outbox.relay import Progress, RelayStore, ShardProgress
from tests.helpers import (
    count_published,
    execute,
    fast_settings,
    insert_rows,
    outbox_rows,
    publish_all,
    query_all,
    query_one,
    read_committed,
    read_topics,
    running_relay,
    scalar,
    set_topic_config,
    signals_of,
    wait_until,
)

pytestmark = pytest.mark.integration


def _sample(relay: Relay, name: str, **labels: str) -> float:
    return relay.metrics.registry.get_sample_value(name, labels) or 0.0


def _seqs(engine: sa.Engine) -> dict[str, int]:
    return {str(r.id): r.seq for r in query_all(engine, "SELECT id, seq FROM oncely_outbox")}


def _first_occurrences_in_seq_order(records: list, seqs: dict[str, int]) -> None:  # type: ignore[type-arg]
    """Per key, the first copy of each event appears in seq order (duplicates may follow)."""
    by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        by_key[(record.topic, record.key)].append(seqs[record.headers["id"].decode()])
    for key, order in by_key.items():
        first = list(dict.fromkeys(order))
        assert first == sorted(first), f"per-key order broken for {key}"


def test_ten_thousand_events_are_published_once_in_per_key_order(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topics = [new_topic(partitions=3) for _ in range(3)]
    insert_rows(engine, outbox_rows(10_000, topics=topics, keys=100))
    relay = publish_all(
        engine, kafka_bootstrap, 10_000, fast_settings(**relay_mode, batch_size=500), timeout=120
    )
    assert _sample(relay, "oncely_relay_progress_refused_total") == 0
    assert sum(_sample(relay, "oncely_relay_published_total", topic=t) for t in topics) == 10_000
    in_transactions = _sample(relay, "oncely_relay_transactions_total", outcome="committed") > 0
    assert in_transactions == bool(relay_mode), "transactions exactly once, and only then"

    records = read_committed(kafka_bootstrap, topics)
    by_id = Counter(record.headers["id"].decode() for record in records)
    assert len(records) == 10_000
    assert set(by_id.values()) == {1}, "a record was published twice"
    seqs = _seqs(engine)
    assert set(by_id) == set(seqs)
    assert {record.headers["eventType"] for record in records} == {b"test.event"}
    created = {
        str(r.id): r.ms
        for r in query_all(
            engine,
            "SELECT id, floor(extract(epoch FROM created_at) * 1000) AS ms FROM oncely_outbox",
        )
    }
    assert all(r.timestamp == created[r.headers["id"].decode()] for r in records), (
        "a record's timestamp is not its row's created_at in ms"
    )
    _first_occurrences_in_seq_order(records, seqs)
    untouched = query_one(
        engine,
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'oncely_outbox'",
    )
    assert untouched.n_tup_upd == 0, "the relay never updates an outbox row"


def test_a_late_committing_transaction_is_not_skipped(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    [early] = outbox_rows(1, topics=[topic], keys=1)
    [late] = outbox_rows(1, topics=[topic], keys=1)
    late["aggregateid"] = "another-key"
    with engine.connect() as t1, running_relay(engine, kafka_bootstrap, fast_settings()):
        t1.begin()
        t1.execute(sa.insert(outbox), early)  # lower seq, still uncommitted
        insert_rows(engine, [late])  # higher seq, committed
        wait_until(lambda: count_published(engine) == 1, timeout=30)
        assert {r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic])} == {
            str(late["id"])
        }
        t1.commit()
        wait_until(lambda: count_published(engine) == 2, timeout=30)
    ids = [record.headers["id"].decode() for record in read_topics(kafka_bootstrap, [topic])]
    assert sorted(ids) == sorted([str(early["id"]), str(late["id"])])


def test_a_transaction_open_through_a_long_drain_is_published_when_it_commits(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    [early] = outbox_rows(1, topics=[topic], keys=1)
    with engine.connect() as t1, running_relay(engine, kafka_bootstrap, fast_settings()) as relay:
        t1.begin()
        t1.execute(sa.insert(outbox), early)
        for _ in range(10):
            insert_rows(engine, outbox_rows(2000, topics=[topic], keys=200))
        wait_until(lambda: count_published(engine) == 20_000, timeout=120)
        t1.commit()
        wait_until(lambda: count_published(engine) == 20_001, timeout=30)
    records = read_topics(kafka_bootstrap, [topic])
    assert len({r.headers["id"] for r in records}) == 20_001
    assert _sample(relay, "oncely_relay_published_total", topic=topic) == 20_001


def test_savepoints_publish_with_the_outer_commit_and_not_when_rolled_back(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    from sqlalchemy.orm import Session

    topic = new_topic()
    kept, dropped, aborted = (outbox_rows(1, topics=[topic], keys=1)[0] for _ in range(3))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        with Session(engine) as session, session.begin():
            with session.begin_nested():
                session.execute(sa.insert(outbox), kept)
            savepoint = session.begin_nested()
            session.execute(sa.insert(outbox), dropped)
            savepoint.rollback()
        with Session(engine) as session:
            session.begin()
            with session.begin_nested():
                session.execute(sa.insert(outbox), aborted)
            session.rollback()
        wait_until(lambda: count_published(engine) == 1, timeout=30)
        time.sleep(1)
    ids = [record.headers["id"].decode() for record in read_topics(kafka_bootstrap, [topic])]
    assert ids == [str(kept["id"])]


def test_pages_after_a_full_one_come_from_its_cursor_and_a_replay_reads_again(
    engine: sa.Engine,
) -> None:
    store = RelayStore(engine, owner="reader")
    shards = list(range(32))
    done, _ = store.snapshot()
    insert_rows(engine, outbox_rows(2_500, topics=["t"], keys=7))
    reading, _ = store.snapshot()
    insert_rows(engine, outbox_rows(100, topics=["t"], keys=7))  # after `reading`: not in it

    def page(after_seq: int, reader: RelayStore = store) -> list[int]:
        rows = reader.read(shards, done=done, reading=reading, after_seq=after_seq, page_size=1000)
        return [row.seq for row in rows]

    def fresh(after_seq: int) -> list[int]:
        reader = RelayStore(engine, owner="fresh")  # no cursor: a plain query
        try:
            return page(after_seq, reader)
        finally:
            reader.close()

    first = page(0)
    second = page(first[-1])  # from the cursor the first read left
    assert first == fresh(0)
    assert second == fresh(first[-1])
    assert page(first[-1]) == second, "a replay from a recorded position must read it again"
    assert page(0) == first, "a replay from the start must read the first page again"
    assert page(first[-1]) == second
    third = page(second[-1])
    assert len(first) == len(second) == 1000
    assert third == fresh(second[-1]) and len(third) == 500
    assert first + second + third == sorted(set(first + second + third))
    assert page(third[-1]) == []
    store.close()


def test_two_relays_share_the_shards_and_publish_every_row_once(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topics = [new_topic(partitions=3)]
    settings = fast_settings(**relay_mode, batch_size=100, lease_seconds=3.0)
    with running_relay(engine, kafka_bootstrap, settings) as first:
        wait_until(lambda: len(first.shards) == 32, timeout=20)
        with running_relay(engine, kafka_bootstrap, settings) as second:
            wait_until(lambda: (len(first.shards), len(second.shards)) == (16, 16), timeout=30)
            assert not first.shards & second.shards
            insert_rows(engine, outbox_rows(3000, topics=topics, keys=50))
            wait_until(lambda: count_published(engine) == 3000, timeout=120)
            for relay in (first, second):
                assert _sample(relay, "oncely_relay_published_total", topic=topics[0]) > 0
        wait_until(lambda: len(first.shards) == 32, timeout=30)  # the second handed back
        insert_rows(engine, outbox_rows(300, topics=topics, keys=50))
        wait_until(lambda: count_published(engine) == 3300, timeout=60)
    records = read_committed(kafka_bootstrap, topics)
    assert len({record.headers["id"] for record in records}) == 3300
    assert len(records) == 3300, "a graceful hand-off publishes nothing twice"
    for relay in (first, second):
        assert _sample(relay, "oncely_relay_progress_refused_total") == 0


def test_progress_of_a_shard_taken_over_is_refused(engine: sa.Engine) -> None:
    zombie, taker = RelayStore(engine, owner="zombie"), RelayStore(engine, owner="taker")
    leases = zombie.acquire(wanted=2, lease_seconds=0.5)
    assert [lease.shard for lease in leases] == [0, 1]
    others = taker.acquire(wanted=32, lease_seconds=30)
    assert sorted(lease.shard for lease in others) == list(range(2, 32)), "leased ones are not"
    time.sleep(0.6)
    taken = {lease.shard: lease for lease in taker.acquire(wanted=2, lease_seconds=30)}
    assert set(taken) == {0, 1} and taken[0].epoch == leases[0].epoch + 1
    snapshot, _ = zombie.snapshot()
    late = zombie.record(
        [ShardProgress(lease.shard, lease.epoch, Progress(snapshot)) for lease in leases]
    )
    assert late == set(), "a zombie cannot move progress"
    beat = zombie.heartbeat(
        ttl_seconds=5, asleep=False, leases=[(lease.shard, lease.epoch) for lease in leases]
    )
    assert beat.kept == frozenset(), "a zombie cannot renew"
    assert taker.record([ShardProgress(0, taken[0].epoch, Progress(snapshot))]) == {0}
    zombie.close()


def test_losing_one_shard_of_a_page_does_not_record_the_others_before_their_acks(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A page is read from every shard at one position; when one of them is taken over while
    the page is in flight, the shards kept still record it only once the broker acked it."""
    topic = new_topic(partitions=3)
    # Records wait 3 s in the producer, ticks (lease renewals) come every 0.5 s.
    settings = fast_settings(lease_seconds=1.5, linger_ms=3000)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: len(relay.shards) == 32, timeout=20)
        time.sleep(1)  # every shard read once (nothing there): all at one position
        insert_rows(engine, outbox_rows(20, topics=[topic], keys=20))
        time.sleep(0.2)  # read and produced as one page, lingering
        with engine.begin() as conn:
            taken = scalar(
                conn,
                "UPDATE oncely_relay_shards SET owner = 'taker', epoch = epoch + 1,"
                " lease_until = now() + interval '1 minute'"
                " WHERE shard = (SELECT min(shard) FROM oncely_outbox) RETURNING shard",
            )
        signals_of(relay).wait_for(Signal.LOST, shard=taken, timeout=10)
        assert taken not in relay.shards
        wait_until(lambda: count_published(engine) > 0, timeout=30, interval=0.05)
        published = count_published(engine)
        on_broker = len(read_topics(kafka_bootstrap, [topic]))
        assert on_broker >= published, (
            f"{published} rows recorded as published, {on_broker} records on the broker"
        )
        lost = scalar(engine, "SELECT count(*) FROM oncely_outbox WHERE shard = :s", s=taken)
        wait_until(lambda: count_published(engine) == 20 - lost, timeout=30)
    assert _sample(relay, "oncely_relay_lease_lost_total") == 1


def test_a_relay_paused_inside_a_transaction_cannot_keep_its_shards(
    engine: sa.Engine, database_url: str
) -> None:
    """A relay process paused (SIGSTOP) between a statement and its commit holds its shards'
    rows locked; the server ends that idle transaction, so a successor can take them over."""
    settings = fast_settings(lease_seconds=1.0)
    options = {"options": session_options(database_url, settings)}
    paused = sa.create_engine(database_url, connect_args=options)
    try:
        zombie, taker = RelayStore(paused, owner="zombie"), RelayStore(engine, owner="taker")
        assert len(zombie.acquire(wanted=32, lease_seconds=1.0)) == 32
        with paused.connect() as conn:
            conn.execute(
                sa.text("UPDATE oncely_relay_shards SET updated_at = now() WHERE owner = 'zombie'")
            )  # as relay_record does, then the process is paused before its commit
            time.sleep(2.5)  # past the lease and the idle-transaction timeout
            taken = taker.acquire(wanted=32, lease_seconds=30)
            assert len(taken) == 32, f"{len(taken)} of 32 shards taken over"
            with pytest.raises(sa.exc.DBAPIError, match="idle-in-transaction timeout"):
                conn.execute(sa.text("SELECT 1"))  # resumed: its transaction was ended
    finally:
        paused.dispose()


def _parked(engine: sa.Engine) -> list[tuple[str, str, str | None]]:
    rows = query_all(
        engine, "SELECT aggregateid, reason, error FROM oncely_relay_parked ORDER BY 1"
    )
    return [(r.aggregateid, r.reason, r.error) for r in rows]


def _held(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [
            str(i)
            for i in conn.execute(
                sa.text("SELECT event_id FROM oncely_relay_held ORDER BY position")
            ).scalars()
        ]


def _request(engine: sa.Engine, request: str) -> None:
    execute(engine, "UPDATE oncely_relay_parked SET request = :r", r=request)


def test_a_record_the_client_refuses_parks_its_key_and_skip_releases_it(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topic = new_topic()
    rows = outbox_rows(12, topics=[topic], keys=4)  # key-0 .. key-3, three rows each
    rows[0]["payload"] = b"x" * 1_100_000  # over message.max.bytes: the first of key-0
    insert_rows(engine, rows)
    settings = fast_settings(
        **relay_mode, max_attempts=2, initial_backoff_seconds=0.1, max_backoff_seconds=0.2
    )
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: count_published(engine) == 9, timeout=60)
        wait_until(lambda: len(_held(engine)) == 2, timeout=30)
        [(key, reason, error)] = _parked(engine)
        assert (key, reason) == ("key-0", "dead")
        assert error is not None and "MSG_SIZE_TOO_LARGE" in error
        failed = query_one(
            engine, "SELECT attempts, first_failed_at, parked_at FROM oncely_relay_parked"
        )
        assert failed.attempts == 2, "its own attempts, as many as max_attempts"
        assert failed.first_failed_at < failed.parked_at, "the first failure, then the last"
        assert _held(engine) == [str(rows[4]["id"]), str(rows[8]["id"])], "the key waits"
        assert _sample(relay, "oncely_relay_dead_total", topic=topic) == 1
        mark = signals_of(relay).mark()
        _request(engine, "skip")
        signals_of(relay).wait_for(Signal.RELEASED, after=mark, timeout=30)
        assert _parked(engine) == []
        assert _held(engine) == []
    skipped = query_all(engine, "SELECT event_id, aggregateid FROM oncely_relay_skipped")
    assert [(r.event_id, r.aggregateid) for r in skipped] == [(rows[0]["id"], "key-0")]
    records = read_committed(kafka_bootstrap, [topic])
    key0 = [r.headers["id"].decode() for r in records if r.key == "key-0"]
    assert key0 == [str(rows[4]["id"]), str(rows[8]["id"])]
    assert len(records) == 11


def test_a_record_the_broker_refuses_parks_its_key_and_requeue_publishes_in_order(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topic = new_topic(partitions=1, config={"max.message.bytes": "10000"})
    rows = outbox_rows(30, topics=[topic], keys=3)  # key-0 .. key-2 share the one partition
    rows[3]["payload"] = os.urandom(50_000)  # key-0's second: under the client's limit only
    insert_rows(engine, rows)
    settings = fast_settings(**relay_mode, max_attempts=1)
    with running_relay(engine, kafka_bootstrap, settings):
        wait_until(lambda: count_published(engine) == 21, timeout=60)
        wait_until(lambda: len(_held(engine)) == 8, timeout=30)
        assert [(k, r) for k, r, _ in _parked(engine)] == [("key-0", "dead")]
        on_broker = read_committed(kafka_bootstrap, [topic])
        assert {r.key for r in on_broker} == {"key-0", "key-1", "key-2"}
        assert [r.headers["id"].decode() for r in on_broker if r.key == "key-0"] == [
            str(rows[0]["id"])
        ], "no later row of the parked key was published"

        set_topic_config(kafka_bootstrap, topic, "max.message.bytes", "200000")
        _request(engine, "requeue")
        wait_until(lambda: count_published(engine) == 30, timeout=60)
    records = read_committed(kafka_bootstrap, [topic])
    key0 = [r.headers["id"].decode() for r in records if r.key == "key-0"]
    assert key0 == [str(row["id"]) for row in rows if row["aggregateid"] == "key-0"]
    assert len(records) == 30


def test_a_delayed_row_holds_its_key_until_due_and_other_keys_flow(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topic = new_topic()
    rows = outbox_rows(6, topics=[topic], keys=2)
    due = datetime.now(UTC) + timedelta(seconds=4)
    rows[0]["available_at"] = due
    insert_rows(engine, rows[:1])
    insert_rows(engine, rows[1:])
    with running_relay(engine, kafka_bootstrap, fast_settings(**relay_mode, lease_seconds=1.5)):
        wait_until(lambda: count_published(engine) == 3, timeout=30)
        assert [(k, r) for k, r, _ in _parked(engine)] == [("key-0", "delayed")]
        assert datetime.now(UTC) < due
        wait_until(lambda: count_published(engine) == 6, timeout=30)
    assert datetime.now(UTC) >= due
    records = read_committed(kafka_bootstrap, [topic])
    key0 = [r.headers["id"].decode() for r in records if r.key == "key-0"]
    assert key0 == [str(row["id"]) for row in rows if row["aggregateid"] == "key-0"]


def drain_a_hot_key_and_a_huge_transaction(
    engine: sa.Engine, bootstrap: str, topic: str, huge: int
) -> None:
    """5,000 rows of one key, then ``huge`` rows of 1,000 keys committed in one transaction: each
    published once, in per-key order. tests/chaos/test_relay_volume.py runs it with 100,000."""
    insert_rows(engine, outbox_rows(5000, topics=[topic], keys=1))
    with running_relay(engine, bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == 5000, timeout=60)
        insert_rows(engine, outbox_rows(huge, topics=[topic], keys=1000, payload=b"x" * 50))
        wait_until(lambda: count_published(engine) == 5000 + huge, timeout=300, interval=1)
    records = read_topics(bootstrap, [topic], timeout=120)
    assert len({r.headers["id"] for r in records}) == 5000 + huge
    _first_occurrences_in_seq_order(records, _seqs(engine))


def test_a_hot_key_and_a_huge_transaction_drain(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # 30,000 rows in one transaction: pages grow to their cap (half of max_in_flight, 5,000)
    # and the in-flight bound holds the relay back several times; make chaos runs 100,000.
    drain_a_hot_key_and_a_huge_transaction(engine, kafka_bootstrap, new_topic(partitions=3), 30_000)


def test_the_relay_rides_out_a_broker_outage(engine: sa.Engine, tmp_path: Path) -> None:
    from confluent_kafka.admin import NewTopic

    from oncely.devstack import KafkaNode

    broker = KafkaNode(data_dir=tmp_path / "kafka")
    broker.start()
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        admin.create_topics([NewTopic("outage", num_partitions=2)])["outage"].result(30)
        insert_rows(engine, outbox_rows(200, topics=["outage"], keys=10))
        settings = fast_settings(delivery_timeout_ms=2000, max_backoff_seconds=1.0)
        with running_relay(engine, broker.bootstrap_servers, settings) as relay:
            wait_until(lambda: count_published(engine) == 200, timeout=60)
            broker.stop()
            insert_rows(engine, outbox_rows(200, topics=["outage"], keys=10))
            wait_until(
                lambda: (
                    sum(
                        s.value
                        for m in relay.metrics.registry.collect()
                        if m.name == "oncely_relay_produce_errors"
                        for s in m.samples
                        if s.name.endswith("_total")
                    )
                    >= 2
                ),
                timeout=60,
            )
            assert count_published(engine) == 200, "nothing recorded without a report"
            assert _parked(engine) == [], "a broker outage never dead-letters"
            broker.start()
            wait_until(lambda: count_published(engine) == 400, timeout=120)
        records = read_topics(broker.bootstrap_servers, ["outage"])
        seqs = _seqs(engine)
        assert {record.headers["id"].decode() for record in records} == set(seqs)
        _first_occurrences_in_seq_order(records, seqs)
    finally:
        broker.stop()


def test_a_stopped_relay_resumes_where_it_recorded(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    insert_rows(engine, outbox_rows(2000, topics=[topic], keys=20))
    publish_all(engine, kafka_bootstrap, 2000)
    insert_rows(engine, outbox_rows(500, topics=[topic], keys=20))
    publish_all(engine, kafka_bootstrap, 2500)
    assert len(read_topics(kafka_bootstrap, [topic])) == 2500, "nothing published twice"


def test_metrics_per_shard(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    rows = outbox_rows(500, topics=[topic], keys=50)
    rows[0]["payload"] = b"x" * 1_100_000  # dead-lettered: its key parked
    insert_rows(engine, rows)

    def samples(name: str) -> dict[str, float]:
        return {
            s.labels["shard"]: s.value
            for m in relay.metrics.registry.collect()
            for s in m.samples
            if s.name == name
        }

    with running_relay(engine, kafka_bootstrap, fast_settings(max_attempts=1)) as relay:
        wait_until(lambda: len(_held(engine)) == 9, timeout=60)
        wait_until(
            lambda: sum(samples("oncely_relay_shard_published_total").values()) == 490, timeout=30
        )
        assert len(samples("oncely_relay_lease_epoch")) == 32
        assert sum(samples("oncely_relay_shard_produce_errors_total").values()) >= 1
        wait_until(lambda: sum(samples("oncely_relay_held_keys").values()) == 1, timeout=30)
        wait_until(
            lambda: (
                len(samples("oncely_outbox_unpublished_rows")) == 32
                and sum(samples("oncely_outbox_unpublished_rows").values()) == 0
            ),
            timeout=30,
        )
        assert _sample(relay, "oncely_relay_shards") == 32
