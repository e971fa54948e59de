"""The retention guard against real PostgreSQL and Kafka: an outbox partition with one
unpublished, dead or held row is kept, one whose rows the relay has all passed is dropped; a
receipts partition is kept while Kafka still holds a record of its topics below the mark taken
when it became otherwise droppable (or the outbox still holds its events) and dropped once Kafka
has deleted them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from oncely import retention
from oncely.storage import partitions, upgrade
from tests.helpers import (
    acknowledge_all,
    execute,
    insert_rows,
    outbox_row,
    park,
    scalar,
    uuid7_at,
)

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)
#: Everything older than a minute is past the horizons: only the guard's other checks count.
POLICY = retention.Policy(outbox_horizon=STEP, receipts_horizon=STEP, ahead=2)


@pytest.fixture
def now(engine: sa.Engine) -> datetime:
    """The database's clock, with partitions of the last 20 minutes created."""
    upgrade(engine, partition_every=STEP)
    moment: datetime = scalar(engine, "SELECT now()")
    start = partitions.window_start(moment, STEP)
    with engine.begin() as conn:
        for n in range(1, 21):
            partitions.create_partition(
                conn, "oncely_outbox", start - STEP * n, start - STEP * (n - 1)
            )
            partitions.create_partition(
                conn, "oncely_receipts", start - STEP * n, start - STEP * (n - 1)
            )
    return moment


@pytest.fixture
def log_starts(kafka_bootstrap: str) -> retention.maintenance.AskKafka:
    config = {"bootstrap.servers": kafka_bootstrap}
    return lambda topics: retention.watermarks(config, topics, timeout=15)


def _verdicts(plan: retention.Plan, table: str) -> dict[str, str | None]:
    return {v.partition.name: v.reason for v in plan.verdicts if v.partition.table == table}


def _name(table: str, moment: datetime) -> str:
    return partitions.partition_name(table, partitions.window_start(moment, STEP))


def test_outbox_partitions_with_unpublished_dead_or_held_rows_are_kept(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    times = {
        name: now - timedelta(minutes=minutes)
        for name, minutes in [("published", 15), ("dead", 12), ("held", 9), ("unpublished", 6)]
    }
    rows = {
        name: outbox_row("t", name, event_id=uuid7_at(moment)) for name, moment in times.items()
    }
    insert_rows(engine, [rows["published"], rows["dead"], rows["held"]])
    acknowledge_all(engine)
    park(engine, rows["dead"], "dead")
    parked = outbox_row("t", "held", event_id=uuid7_at(now - timedelta(minutes=30)))
    park(engine, parked, "dead", held=[rows["held"]])
    insert_rows(engine, [rows["unpublished"]])

    plan = retention.plan(engine, POLICY, log_starts)
    verdicts = _verdicts(plan, "oncely_outbox")
    assert verdicts[_name("oncely_outbox", times["published"])] is None
    assert "parked rows (1 dead)" in str(verdicts[_name("oncely_outbox", times["dead"])])
    # Partitions go oldest first: the held one waits for the dead one's partition ...
    assert "waits for the older" in str(verdicts[_name("oncely_outbox", times["held"])])
    execute(engine, "DELETE FROM oncely_relay_parked WHERE event_id = :e", e=rows["dead"]["id"])
    verdicts = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_outbox")
    # ... and says what it waits for itself once that one may go.
    assert "1 row(s) held behind a parked key" in str(
        verdicts[_name("oncely_outbox", times["held"])]
    )

    execute(engine, "DELETE FROM oncely_relay_held")
    execute(engine, "DELETE FROM oncely_relay_parked")
    verdicts = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_outbox")
    assert "has not passed all its rows" in str(
        verdicts[_name("oncely_outbox", times["unpublished"])]
    )

    outcome = retention.run(engine, POLICY, log_starts)
    dropped = set(outcome.dropped)
    for name in ("published", "dead", "held"):
        assert _name("oncely_outbox", times[name]) in dropped
    assert _name("oncely_outbox", times["unpublished"]) not in dropped
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 1  # the unpublished row
    acknowledge_all(engine)
    assert (
        _name("oncely_outbox", times["unpublished"])
        in retention.run(engine, POLICY, log_starts).dropped
    )
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 0


def test_receipts_partition_is_kept_while_kafka_holds_a_record_below_its_mark(
    engine: sa.Engine,
    now: datetime,
    new_topic: Callable[..., str],
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    log_starts: retention.maintenance.AskKafka,
) -> None:
    topic = new_topic()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(3):
        producer.produce(topic, b"x")
    assert producer.flush(30) == 0
    moment = now - timedelta(minutes=10)
    execute(
        engine,
        'INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset")'
        " VALUES (:e, 'send-email', :t, 0, 1)",
        e=uuid7_at(moment),
        t=topic,
    )
    name = _name("oncely_receipts", moment)
    reason = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_receipts")[name]
    assert "not marked yet" in str(reason)  # a plan changes nothing: a run marks it
    assert name not in retention.run(engine, POLICY, log_starts).dropped
    reason = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_receipts")[name]
    assert f"Kafka still holds {topic} [0] from offset 0, marked at 3" in str(reason)

    # Kafka deletes records as retention.ms would: while the log starts below the mark, a
    # record of the partition's events can still come again; once it starts at it, none can.
    _delete_records(kafka_admin, topic, before=2)
    reason = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_receipts")[name]
    assert f"Kafka still holds {topic} [0] from offset 2, marked at 3" in str(reason)
    _delete_records(kafka_admin, topic, before=3)
    assert name in retention.run(engine, POLICY, log_starts).dropped
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_retention_marks") == 0


def _delete_records(admin: AdminClient, topic: str, *, before: int) -> None:
    for future in admin.delete_records([TopicPartition(topic, 0, before)]).values():
        future.result(timeout=30)


def test_receipts_partition_is_kept_while_the_outbox_holds_its_events(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    moment = now - timedelta(minutes=10)
    event = outbox_row("t", event_id=uuid7_at(moment))
    insert_rows(engine, [event])
    execute(
        engine, "INSERT INTO oncely_receipts (event_id, effect) VALUES (:e, 'x')", e=event["id"]
    )
    policy = retention.Policy(outbox_horizon=timedelta(days=1), receipts_horizon=STEP)
    reason = _verdicts(retention.plan(engine, policy, log_starts), "oncely_receipts")[
        _name("oncely_receipts", moment)
    ]
    assert "the outbox still holds its events" in str(reason)


def test_one_run_at_a_time(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    row = outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=10)))
    insert_rows(engine, [row])
    acknowledge_all(engine)
    with engine.connect() as other:
        other.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": retention.maintenance.RUN_LOCK})
        outcome = retention.run(engine, POLICY, log_starts)
        assert outcome.busy and not outcome.errors
        assert not outcome.dropped and not outcome.created
        other.execute(
            sa.text("SELECT pg_advisory_unlock(:k)"), {"k": retention.maintenance.RUN_LOCK}
        )
    assert (
        _name("oncely_outbox", now - timedelta(minutes=10))
        in retention.run(engine, POLICY, log_starts).dropped
    )
