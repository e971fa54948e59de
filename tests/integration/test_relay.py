"""The relay against real Kafka and PostgreSQL: published once, in per-key order, fenced."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from oncely.relay import Relay
from oncely.storage import outbox
from tests.helpers import (
    count_status,
    fast_settings,
    insert_rows,
    outbox_rows,
    read_topics,
    running_relay,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url, pool_size=5)
    yield engine
    engine.dispose()


def _sample(relay: Relay, name: str, **labels: str) -> float:
    return relay.metrics.registry.get_sample_value(name, labels) or 0.0


def _seq_by_id(engine: sa.Engine) -> dict[str, tuple[int, str, int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, seq, status, kafka_partition, kafka_offset FROM oncely_outbox")
        ).all()
    return {str(r.id): (r.seq, r.status, r.kafka_partition, r.kafka_offset) for r in rows}


def test_ten_thousand_events_are_published_once_in_per_key_order(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topics = [new_topic(partitions=3) for _ in range(3)]
    insert_rows(engine, outbox_rows(10_000, topics=topics, keys=100))
    with running_relay(engine, kafka_bootstrap, fast_settings(batch_size=500)) as relay:
        wait_until(lambda: count_status(engine, "published") == 10_000, timeout=120)
    assert _sample(relay, "oncely_relay_lease_lost_total") == 0
    assert sum(_sample(relay, "oncely_relay_published_total", topic=t) for t in topics) == 10_000

    records = read_topics(kafka_bootstrap, topics)
    by_id = Counter(record.headers["id"].decode() for record in records)
    assert len(records) == 10_000
    assert set(by_id.values()) == {1}, "a record was published twice"

    rows = _seq_by_id(engine)
    assert set(by_id) == set(rows)
    seqs_by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        seq, status, partition, offset = rows[record.headers["id"].decode()]
        assert (status, partition, offset) == ("published", record.partition, record.offset)
        assert record.headers["eventType"] == b"test.event"
        seqs_by_key[(record.topic, record.key)].append(seq)
    for key, seqs in seqs_by_key.items():
        assert seqs == sorted(seqs), f"per-key order broken for {key}"


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
        wait_until(lambda: count_status(engine, "published") == 1, timeout=30)
        t1.commit()
        wait_until(lambda: count_status(engine, "published") == 2, timeout=30)
    ids = {record.headers["id"].decode() for record in read_topics(kafka_bootstrap, [topic])}
    assert ids == {str(early["id"]), str(late["id"])}


def test_two_relays_publish_every_row_once(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topics = [new_topic(partitions=3)]
    settings = fast_settings(batch_size=100)
    staged = 0
    with (
        running_relay(engine, kafka_bootstrap, settings) as first,
        running_relay(engine, kafka_bootstrap, settings) as second,
    ):
        # Keep staging until both have published: on a loaded machine the first relay can drain a
        # fixed backlog before the second one's producer is up.
        while staged < 3000 or any(
            _sample(relay, "oncely_relay_published_total", topic=topics[0]) == 0
            for relay in (first, second)
        ):
            assert staged < 30_000, "the second relay never published"
            insert_rows(engine, outbox_rows(500, topics=topics, keys=50))
            staged += 500
            time.sleep(0.1)
        wait_until(lambda: count_status(engine, "published") == staged, timeout=120)
    records = read_topics(kafka_bootstrap, topics)
    assert len(records) == staged
    assert len({record.headers["id"] for record in records}) == staged
    for relay in (first, second):
        assert _sample(relay, "oncely_relay_lease_lost_total") == 0
        assert _sample(relay, "oncely_relay_published_total", topic=topics[0]) > 0, "both worked"


def test_a_settle_after_the_lease_was_lost_is_refused(engine: sa.Engine) -> None:
    from oncely.relay.store import OutboxStore, Published

    insert_rows(engine, outbox_rows(5, topics=["t"], keys=5))
    zombie = OutboxStore(engine, owner="zombie")
    taker = OutboxStore(engine, owner="taker")
    claimed = zombie.claim(batch_size=10, lease_seconds=0.5)
    assert len(claimed) == 5
    assert taker.claim(batch_size=10, lease_seconds=30) == [], "leased rows are not claimable"
    wait_until(lambda: len(taker.claim(batch_size=10, lease_seconds=30)) == 5, timeout=10)
    late = zombie.mark_published(
        [Published(row, 0, i) for i, row in enumerate(claimed)], delete=False
    )
    assert late.settled == 0
    assert sorted(late.lease_lost) == sorted(row.id for row in claimed)
    assert count_status(engine, "published") == 0


def _statuses(engine: sa.Engine, key: str) -> list[tuple[str, int, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT status, attempts, last_error FROM oncely_outbox"
                " WHERE aggregateid = :k ORDER BY seq"
            ),
            {"k": key},
        ).all()
    return [(r.status, r.attempts, r.last_error) for r in rows]


def test_a_permanent_failure_goes_dead_and_parks_only_its_key(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    from oncely.relay import dead

    topic = new_topic()
    rows = outbox_rows(12, topics=[topic], keys=4)  # key-0 .. key-3, three rows each
    rows[0]["payload"] = b"x" * 1_100_000  # over message.max.bytes: the head of key-0
    insert_rows(engine, rows)
    settings = fast_settings(max_attempts=3, backoff_base_seconds=0.1, backoff_max_seconds=0.2)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: count_status(engine, "published") == 9, timeout=60)
        wait_until(lambda: count_status(engine, "dead") == 1, timeout=60)
        [(status, attempts, error), *followers] = _statuses(engine, "key-0")
        assert (status, attempts) == ("dead", 3)
        assert error is not None and "MSG_SIZE_TOO_LARGE" in error
        assert followers == [("pending", 0, None), ("pending", 0, None)], "the key waits"
        assert _sample(relay, "oncely_relay_dead_total", topic=topic) == 1
        assert _sample(relay, "oncely_relay_retries_total", topic=topic) == 2

        [dead_row] = dead.list_dead(engine)
        assert dead_row.id == rows[0]["id"]
        assert [changed.id for changed in dead.skip(engine, ids=[dead_row.id])] == [dead_row.id]
        wait_until(lambda: count_status(engine, "published") == 11, timeout=30)
    assert [s for s, _, _ in _statuses(engine, "key-0")] == ["skipped", "published", "published"]


def test_the_relay_rides_out_a_broker_outage(engine: sa.Engine, tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    from oncely.devstack import KafkaNode

    broker = KafkaNode(data_dir=tmp_path / "kafka")
    broker.start()
    try:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
        admin.create_topics([NewTopic("outage", num_partitions=2)])["outage"].result(30)
        first = outbox_rows(200, topics=["outage"], keys=10)
        insert_rows(engine, first)
        settings = fast_settings(delivery_timeout_ms=2000, backoff_max_seconds=1.0)
        with running_relay(engine, broker.bootstrap_servers, settings):
            wait_until(lambda: count_status(engine, "published") == 200, timeout=60)
            broker.stop()
            insert_rows(engine, outbox_rows(200, topics=["outage"], keys=10))

            def retried() -> bool:
                with engine.connect() as conn:
                    return bool(
                        conn.execute(
                            sa.text(
                                "SELECT count(*) FROM oncely_outbox WHERE status = 'pending'"
                                " AND attempts >= 2 AND last_error IS NOT NULL"
                                " AND available_at > created_at"
                            )
                        ).scalar_one()
                        >= 10
                    )

            wait_until(retried, timeout=60)
            assert count_status(engine, "published") == 200, "nothing published without a report"
            assert count_status(engine, "dead") == 0, "a broker outage never dead-letters"
            broker.start()
            wait_until(lambda: count_status(engine, "published") == 400, timeout=120)
        records = read_topics(broker.bootstrap_servers, ["outage"])
        rows = _seq_by_id(engine)
        assert {record.headers["id"].decode() for record in records} == set(rows)
        seqs: dict[tuple[int, str], list[int]] = defaultdict(list)
        for record in sorted(records, key=lambda r: (r.partition, r.offset)):
            seqs[(record.partition, record.key)].append(rows[record.headers["id"].decode()][0])
        for key, order in seqs.items():
            deduplicated = list(dict.fromkeys(order))
            assert deduplicated == sorted(deduplicated), f"per-key order broken for {key}"
    finally:
        broker.stop()
