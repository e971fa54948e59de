"""The receipts guard against real PostgreSQL and Kafka: copies of a partition's events above
its receipted offsets (F1), topics the principal may not Describe (F2), no lock held while Kafka
is asked (F9), receipts without a Kafka position (F13)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)
from prometheus_client import CollectorRegistry

from oncely import retention
from oncely.relay.housekeeping import Housekeeping
from oncely.retention.guard import KafkaAnswer
from oncely.runtime.metrics import RetentionMetrics
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import partitions
from oncely.storage.stores.outbox.relay import RelayStore
from tests.helpers import (
    acknowledge_all,
    execute,
    fast_settings,
    insert_rows,
    outbox_row,
    partitioned_by_minute,
    scalar,
    uuid7_at,
)
from tests.integration.secure_kafka import USER, SecureKafka

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)
#: Everything older than a minute is past the horizons: only the guard's other checks count.
POLICY = retention.policy_of(
    RetentionSettings(ahead=2), RelaySettings(), outbox_horizon=STEP, receipts_horizon=STEP
)


@pytest.fixture
def now(engine: sa.Engine) -> datetime:
    """The database's clock, with partitions of the last 20 minutes created."""
    return partitioned_by_minute(engine)


def _kafka(config: dict[str, str]) -> retention.maintenance.AskKafka:
    return lambda topics: retention.watermarks(config, topics, timeout=15)


@pytest.fixture
def log_starts(kafka_bootstrap: str) -> retention.maintenance.AskKafka:
    return _kafka({"bootstrap.servers": kafka_bootstrap})


def _name(moment: datetime) -> str:
    return partitions.partition_name("oncely_receipts", partitions.window_start(moment, STEP))


def _receipt(engine: sa.Engine, event_id: uuid.UUID, topic: str | None, offset: int | None) -> None:
    execute(
        engine,
        'INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset")'
        " VALUES (:e, 'send-email', :t, :p, :o)",
        e=event_id,
        t=topic,
        p=None if topic is None else 0,
        o=offset,
    )


def _produce(bootstrap: str, topic: str, *event_ids: uuid.UUID) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for event_id in event_ids:
        producer.produce(topic, b"x", key=b"k", headers={"id": str(event_id).encode()})
    assert producer.flush(30) == 0


def _delete_records(admin: AdminClient, topic: str, *, before: int) -> None:
    for future in admin.delete_records([TopicPartition(topic, 0, before)]).values():
        future.result(timeout=30)


def _reason(plan: retention.Plan, name: str) -> str | None:
    return {v.partition.name: v.reason for v in plan.verdicts}[name]


def test_a_copy_above_the_receipted_offset_keeps_the_receipts_partition(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    """F1: event E applied from offset 0; a filler at 1; E's copy (a republish, a relay's
    duplicate) at 2 is de-duplicated, so the receipt keeps offset 0. Kafka deletes up to 1: a
    re-read would still deliver the copy, so the receipts partition stays until Kafka's log
    start passes the high watermark marked when the partition became otherwise eligible."""
    topic = new_topic()
    moment = now - timedelta(minutes=10)
    event, filler = uuid7_at(moment), uuid7_at(now)
    _produce(kafka_bootstrap, topic, event, filler, event)
    _receipt(engine, event, topic, 0)
    name = _name(moment)
    _delete_records(kafka_admin, topic, before=1)

    assert name not in retention.run(engine, POLICY, log_starts).dropped
    reason = _reason(retention.plan(engine, POLICY, log_starts), name)
    assert f"Kafka still holds {topic} [0] from offset 1, marked at 3" in str(reason)
    _delete_records(kafka_admin, topic, before=2)
    assert name not in retention.run(engine, POLICY, log_starts).dropped
    _delete_records(kafka_admin, topic, before=3)
    assert name in retention.run(engine, POLICY, log_starts).dropped
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_retention_marks") == 0


def test_the_mark_is_discarded_while_the_outbox_holds_the_events_again(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    """F1: a mark taken before the outbox held the events again (a late writer) would not cover
    a republish of them: it is discarded, and taken again once the outbox lets them go."""
    topic = new_topic()
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _produce(kafka_bootstrap, topic, event)
    _receipt(engine, event, topic, 0)
    name = _name(moment)
    assert name not in retention.run(engine, POLICY, log_starts).dropped
    assert scalar(engine, "SELECT high FROM oncely_retention_marks") == 1
    insert_rows(engine, [outbox_row(topic, event_id=event)])
    assert name not in retention.run(engine, POLICY, log_starts).dropped
    assert scalar(engine, "SELECT count(*) FROM oncely_retention_marks") == 0
    _produce(kafka_bootstrap, topic, event)  # republished meanwhile
    execute(engine, "DELETE FROM oncely_outbox")
    _delete_records(kafka_admin, topic, before=1)
    assert name not in retention.run(engine, POLICY, log_starts).dropped  # marked again
    assert scalar(engine, "SELECT high FROM oncely_retention_marks") == 2
    _delete_records(kafka_admin, topic, before=2)
    assert name in retention.run(engine, POLICY, log_starts).dropped


def test_a_deleted_topic_lets_its_receipts_go(
    engine: sa.Engine,
    now: datetime,
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    """F2: asked by name, a topic Kafka says does not exist holds none of its records."""
    topic = f"test-{uuid.uuid4().hex}"  # not new_topic(): this test deletes it
    for future in kafka_admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _produce(kafka_bootstrap, topic, event)
    _receipt(engine, event, topic, 0)
    for future in kafka_admin.delete_topics([topic]).values():
        future.result(30)
    assert log_starts([topic]) == {topic: None}
    assert _name(moment) in retention.run(engine, POLICY, log_starts).dropped


def test_receipts_without_a_kafka_position_keep_their_partition(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    """F13: a receipt without topic, partition and offset was not written by a consumer reading
    Kafka: the guard cannot tell whether Kafka still holds its event, so its partition stays
    until the receipt is deleted."""
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _receipt(engine, event, None, None)
    name = _name(moment)
    outcome = retention.run(engine, POLICY, log_starts)
    assert name not in outcome.dropped
    reason = {v.partition.name: v.reason for v in outcome.kept}[name]
    assert "1 receipt(s) without a Kafka position" in str(reason)
    execute(engine, "DELETE FROM oncely_receipts WHERE event_id = :e", e=event)
    assert name in retention.run(engine, POLICY, log_starts).dropped


def _oncely_locks(engine: sa.Engine) -> list[tuple[str, str, int]]:
    """The locks other sessions hold on oncely's tables now."""
    with engine.connect() as conn:
        return [
            (row[0], row[1], row[2])
            for row in conn.execute(
                sa.text(
                    "SELECT c.relname, l.mode, l.pid FROM pg_locks l"
                    " JOIN pg_class c ON c.oid = l.relation"
                    " WHERE l.database = (SELECT oid FROM pg_database"
                    "  WHERE datname = current_database())"
                    " AND c.relname LIKE 'oncely%' AND l.pid <> pg_backend_pid()"
                )
            )
        ]


def test_no_lock_is_held_while_kafka_is_asked(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    """F9: a plan gathers the database's facts, ends its transaction, then asks Kafka: while
    Kafka is asked (up to its timeout), no oncely table is locked by retention."""
    topic = new_topic()
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _produce(kafka_bootstrap, topic, event, event)
    _receipt(engine, event, topic, 0)
    held: list[list[tuple[str, str, int]]] = []

    def watched(topics: Iterable[str]) -> KafkaAnswer:
        held.append(_oncely_locks(engine))
        return log_starts(topics)

    name = _name(moment)
    assert name not in retention.run(engine, POLICY, watched).dropped  # marks it
    assert name not in retention.run(engine, POLICY, watched).dropped
    retention.plan(engine, POLICY, watched)
    _delete_records(kafka_admin, topic, before=2)
    assert name in retention.run(engine, POLICY, watched).dropped
    assert held == [[]] * len(held)
    assert len(held) == 4, "Kafka was asked by each"


def test_a_marked_partition_is_not_scanned_again_until_its_drop(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """F9: a receipts partition waiting on Kafka is scanned once, to mark it; later runs and
    plans read its mark; the check under its lock at drop time scans it again."""
    topic = new_topic()
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _produce(kafka_bootstrap, topic, event)
    _receipt(engine, event, topic, 0)
    scanned: list[str] = []
    receipted = partitions.receipted

    def counted(conn: sa.Connection, partition: partitions.Partition) -> partitions.Receipted:
        scanned.append(partition.name)
        return receipted(conn, partition)

    monkeypatch.setattr(partitions, "receipted", counted)
    name = _name(moment)
    for _ in range(3):
        assert name not in retention.run(engine, POLICY, log_starts).dropped
        retention.plan(engine, POLICY, log_starts)
    assert scanned.count(name) == 1
    _delete_records(kafka_admin, topic, before=1)
    assert name in retention.run(engine, POLICY, log_starts).dropped
    assert scanned.count(name) == 2  # the check under the lock


def test_a_busy_run_neither_plans_nor_asks_kafka(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    """F9: a run that finds another one in progress does nothing, not even a plan."""
    topic = new_topic()
    event = uuid7_at(now - timedelta(minutes=10))
    _produce(kafka_bootstrap, topic, event)
    _receipt(engine, event, topic, 0)
    asked: list[object] = []

    def counted(topics: Iterable[str]) -> KafkaAnswer:
        asked.append(topics)
        return log_starts(topics)

    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": retention.maintenance.RUN_LOCK})
        outcome = retention.run(engine, POLICY, counted)
        other.execute(
            sa.text("SELECT pg_advisory_unlock(:k)"), {"k": retention.maintenance.RUN_LOCK}
        )
    assert outcome.busy
    assert asked == []
    assert outcome.plan is None


@pytest.mark.timeout(300)
def test_a_topic_the_principal_may_not_describe_is_not_deleted(
    engine: sa.Engine, now: datetime, secure_kafka: SecureKafka
) -> None:
    """F2: Kafka leaves a topic the principal may not Describe out of its metadata; that is no
    answer, not a deleted topic: the receipts partition stays (Kafka still holds the record)."""
    admin = AdminClient({"bootstrap.servers": secure_kafka.plaintext})
    topic = f"test-denied-{uuid.uuid4().hex}"
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)
    moment = now - timedelta(minutes=10)
    event = uuid7_at(moment)
    _produce(secure_kafka.plaintext, topic, event)
    deny = AclBinding(
        ResourceType.TOPIC,
        topic,
        ResourcePatternType.LITERAL,
        f"User:{USER}",
        "*",
        AclOperation.ALL,
        AclPermissionType.DENY,
    )
    for future in admin.create_acls([deny]).values():
        future.result(30)
    _receipt(engine, event, topic, 0)
    denied = _kafka(secure_kafka.client_config(tls=False))
    outcome = retention.run(engine, POLICY, denied)
    assert _name(moment) not in outcome.dropped
    reason = {v.partition.name: v.reason for v in outcome.kept}[_name(moment)]
    assert f"Kafka did not answer about {topic}" in str(reason)
    assert scalar(engine, "SELECT count(*) FROM oncely_retention_marks") == 0


def test_the_relay_s_retention_keeps_its_gauges_when_busy_and_backs_off_after_a_lock_refusal(
    engine: sa.Engine, now: datetime, kafka_bootstrap: str
) -> None:
    """F9 and F13: a busy run leaves the gauges as the last plan set them (it used to zero
    ``oncely_retention_kept_partitions``); a drop whose lock is not granted makes the relay
    skip the next intervals (the project's Backoff) instead of stalling staging each time."""
    registry = CollectorRegistry()
    housekeeping = Housekeeping(
        store=RelayStore(engine, owner="test"),
        settings=fast_settings(retention_seconds=60, purge_interval_seconds=60),
        retention_settings=RetentionSettings(
            receipts_horizon_seconds=60, lock_timeout_seconds=0.2, ahead=2
        ),
        kafka={"bootstrap.servers": kafka_bootstrap},
        metrics=RetentionMetrics(registry),
    )

    def kept() -> float | None:
        return registry.get_sample_value(
            "oncely_retention_kept_partitions", {"table": "oncely_outbox"}
        )

    def one_run() -> None:
        runs = housekeeping.runs
        housekeeping.due()
        housekeeping.join(60)
        assert housekeeping.runs == runs + 1

    unpublished = outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=10)))
    insert_rows(engine, [unpublished])
    one_run()
    before = kept()
    assert before is not None and before > 0
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": retention.maintenance.RUN_LOCK})
        one_run()
        other.execute(
            sa.text("SELECT pg_advisory_unlock(:k)"), {"k": retention.maintenance.RUN_LOCK}
        )
    assert kept() == before

    acknowledge_all(engine)  # its partition may go now: a writer holds it
    name = partitions.partition_name(
        "oncely_outbox", partitions.window_start(now - timedelta(minutes=10), STEP)
    )
    with engine.begin() as writer:
        writer.exec_driver_sql(f"LOCK TABLE {name} IN ROW EXCLUSIVE MODE")
        one_run()
    ahead = partitions.partition_name(
        "oncely_outbox", partitions.window_start(now, STEP) + 2 * STEP
    )
    execute(engine, f"DROP TABLE {ahead}")
    one_run()  # backs off: drops nothing, though nothing holds the partition now ...
    assert scalar(engine, "SELECT to_regclass(:n) IS NOT NULL", n=name)
    # ... but still creates the partitions ahead, so they never run out while it backs off.
    assert scalar(engine, "SELECT to_regclass(:n) IS NOT NULL", n=ahead)
