"""The retention guard against real PostgreSQL and Kafka: an outbox partition with one
unpublished row is kept, one whose rows the relay has all passed is dropped (its dead, delayed
and held rows kept aside for the relay, which publishes them at release); a receipts partition
is kept while Kafka still holds a record of its topics below the mark taken when it became
otherwise droppable (or the outbox still holds its events, kept rows included) and dropped once
Kafka has deleted them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from oncely import debezium, retention
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import partitions
from oncely.storage.stores.outbox import dead
from tests.helpers import (
    acknowledge_all,
    count_published,
    execute,
    fast_settings,
    insert_rows,
    oncely_cli,
    outbox_row,
    park,
    partitioned_by_minute,
    query_all,
    read_topics,
    running_relay,
    scalar,
    uuid7_at,
    wait_until,
)

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


@pytest.fixture
def log_starts(kafka_bootstrap: str) -> retention.maintenance.AskKafka:
    config = {"bootstrap.servers": kafka_bootstrap}
    return lambda topics: retention.watermarks(config, topics, timeout=15)


def _verdicts(plan: retention.Plan, table: str) -> dict[str, str | None]:
    return {v.partition.name: v.reason for v in plan.verdicts if v.partition.table == table}


def _name(table: str, moment: datetime) -> str:
    return partitions.partition_name(table, partitions.window_start(moment, STEP))


def test_outbox_partitions_with_unpublished_rows_are_kept_dead_and_held_rows_kept_aside(
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
    # A dead row, or a row held behind a parked key, does not keep its partition (F8) ...
    for name in ("published", "dead", "held"):
        assert verdicts[_name("oncely_outbox", times[name])] is None
    assert "has not passed all its rows" in str(
        verdicts[_name("oncely_outbox", times["unpublished"])]
    )

    outcome = retention.run(engine, POLICY, log_starts)
    dropped = set(outcome.dropped)
    for name in ("published", "dead", "held"):
        assert _name("oncely_outbox", times[name]) in dropped
    assert _name("oncely_outbox", times["unpublished"]) not in dropped
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 1  # the unpublished row
    # ... the drop kept them aside, and only them.
    assert set(_kept_ids(engine)) == {str(rows["dead"]["id"]), str(rows["held"]["id"])}
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
    policy = retention.policy_of(
        RetentionSettings(),
        RelaySettings(),
        outbox_horizon=timedelta(days=1),
        receipts_horizon=STEP,
    )
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


def _published_ids(bootstrap: str, topic: str) -> list[str]:
    """The ids of ``topic``'s records, in offset order (one partition)."""
    return [r.headers["id"].decode() for r in read_topics(bootstrap, [topic])]


def _kept_ids(engine: sa.Engine) -> list[str]:
    return [str(r.id) for r in query_all(engine, "SELECT id FROM oncely_relay_kept ORDER BY seq")]


def test_a_delayed_key_no_longer_holds_back_its_partition_and_every_later_one(
    engine: sa.Engine,
    now: datetime,
    log_starts: retention.maintenance.AskKafka,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    """F8: a row delayed an hour in an old partition, two rows of its key held behind it in
    later ones, and 10 later partitions whose rows are all published: the 11 are dropped, the
    delayed and held rows kept aside (their idempotency key still reserved), and once the row
    is due the relay publishes it and its held rows once each, in the key's order."""
    topic = new_topic()
    delayed = outbox_row(
        topic,
        "late",
        event_id=uuid7_at(now - timedelta(minutes=13)),
        event_key="reminder-1",
        available_at=now + timedelta(hours=1),
    )
    behind = [
        outbox_row(topic, "late", event_id=uuid7_at(now - timedelta(minutes=m))) for m in (9, 6)
    ]
    others = [
        outbox_row(topic, f"k{m}", event_id=uuid7_at(now - timedelta(minutes=m)))
        for m in range(12, 2, -1)
    ]
    insert_rows(engine, [delayed])
    insert_rows(engine, [*behind, *others])
    for row in others:
        execute(
            engine, "INSERT INTO oncely_receipts (event_id, effect) VALUES (:e, 'x')", e=row["id"]
        )
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == len(others), timeout=60)
    assert scalar(engine, "SELECT reason FROM oncely_relay_parked") == "delayed"
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_held") == 2

    names = [_name("oncely_outbox", now - timedelta(minutes=m)) for m in range(13, 2, -1)]
    outcome = retention.run(engine, POLICY, log_starts)
    assert set(names) <= set(outcome.dropped), {v.partition.name: v.reason for v in outcome.kept}
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 0
    order = [str(delayed["id"]), *(str(row["id"]) for row in behind)]
    assert _kept_ids(engine) == order
    # The receipts of the delayed row's range: its copy can still be delivered.
    receipts = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_receipts")
    reason = receipts[_name("oncely_receipts", now - timedelta(minutes=13))]
    assert "the outbox still holds its events" in str(reason)
    # The kept row's idempotency key stays taken.
    again = outbox_row(topic, "late", event_id=uuid7_at(now), event_key="reminder-1")
    with pytest.raises(sa.exc.IntegrityError, match="oncely_outbox_event_key_key"):
        insert_rows(engine, [again])

    execute(engine, "UPDATE oncely_relay_parked SET until = now()")  # an hour later
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: not _kept_ids(engine), timeout=60)
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_parked") == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_held") == 0
    published = _published_ids(kafka_bootstrap, topic)
    assert sorted(published) == sorted([*order, *(str(row["id"]) for row in others)])
    assert [i for i in published if i in order] == order
    receipts = _verdicts(retention.plan(engine, POLICY, log_starts), "oncely_receipts")
    reason = receipts[_name("oncely_receipts", now - timedelta(minutes=13))]
    assert "the outbox still holds its events" not in str(reason)
    insert_rows(engine, [again])  # the key is free once its row went out


def test_a_dead_row_whose_partition_was_dropped_is_requeued_once(
    engine: sa.Engine,
    database_url: str,
    now: datetime,
    log_starts: retention.maintenance.AskKafka,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    """F8: a dead row and a row held behind its key no longer keep their partitions; `oncely
    dead list` still shows the dead row, and `oncely dead requeue` publishes both, once."""
    topic = new_topic()
    failed = outbox_row(topic, "k", event_id=uuid7_at(now - timedelta(minutes=10)))
    held = outbox_row(topic, "k", event_id=uuid7_at(now - timedelta(minutes=8)))
    insert_rows(engine, [failed, held])
    acknowledge_all(engine)
    park(engine, failed, "dead", held=[held], error="MSG_SIZE_TOO_LARGE: too big")

    dropped = retention.run(engine, POLICY, log_starts).dropped
    assert _name("oncely_outbox", now - timedelta(minutes=10)) in dropped
    assert _name("oncely_outbox", now - timedelta(minutes=8)) in dropped
    assert _kept_ids(engine) == [str(failed["id"]), str(held["id"])]

    url = ("--database-url", database_url)
    listed = oncely_cli("dead", "list", *url)
    assert listed.exit_code == 0, listed.output
    assert f"{failed['id']}  topic={topic}  key=k  type=account.credited  held=1" in listed.stdout
    requeued = oncely_cli("dead", "requeue", "--yes", str(failed["id"]), *url)
    assert requeued.exit_code == 0, requeued.output
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: not _kept_ids(engine), timeout=60)
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_parked") == 0
    assert _published_ids(kafka_bootstrap, topic) == [str(failed["id"]), str(held["id"])]


@pytest.mark.parametrize("request_", ["requeue", "skip"])
def test_a_delayed_row_is_requeued_or_skipped_before_it_is_due(
    engine: sa.Engine,
    request_: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    """Requeue publishes a delayed row now (then the rows held behind its key); skip never
    publishes it (the held rows go out without it)."""
    topic = new_topic()
    later: datetime = scalar(engine, "SELECT now() + interval '1 day'")
    delayed = outbox_row(topic, "k", available_at=later)
    behind = outbox_row(topic, "k")
    insert_rows(engine, [delayed])
    insert_rows(engine, [behind])
    with running_relay(engine, kafka_bootstrap, fast_settings()) as relay:
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_relay_held") == 1, timeout=60
        )
        named = dead.matching_dead(engine, ids=[delayed["id"]])  # what the dry run shows
        assert [(row.id, row.reason, row.until) for row in named] == [
            (delayed["id"], "delayed", later)
        ]
        act = dead.requeue if request_ == "requeue" else dead.skip
        assert [row.id for row in act(engine, ids=[delayed["id"]])] == [delayed["id"]]
        wait_until(
            lambda: not scalar(engine, "SELECT count(*) FROM oncely_relay_parked"), timeout=60
        )
        assert relay.healthy
    expected = (
        [str(behind["id"])] if request_ == "skip" else [str(delayed["id"]), str(behind["id"])]
    )
    assert _published_ids(kafka_bootstrap, topic) == expected


def test_requeue_of_every_dead_row_leaves_delayed_rows_alone(engine: sa.Engine) -> None:
    """Only a delayed row named by its id is released early: --all and --topic act on dead
    rows only."""
    rows = [outbox_row("t", "a"), outbox_row("t", "b")]
    insert_rows(engine, rows)
    acknowledge_all(engine)
    park(engine, rows[0], "dead")
    park(engine, rows[1], "delayed", until_seconds=3600)
    assert [row.id for row in dead.requeue(engine)] == [rows[0]["id"]]
    assert [row.id for row in dead.requeue(engine, topic="t")] == [rows[0]["id"]]


def test_debezium_s_first_snapshot_reads_kept_rows_as_outbox_rows(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    """Switching to Debezium after retention kept rows aside: the connector's first snapshot
    reads a delayed row and the row held behind it from their copies, with the outbox's
    columns and values, in seq order (not a dead row, as from the outbox)."""
    delayed = outbox_row("t", "late", event_id=uuid7_at(now - timedelta(minutes=10)))
    behind = outbox_row(
        "t", "late", event_id=uuid7_at(now - timedelta(minutes=8)), payload=b"\x00\xffbytes"
    )
    failed = outbox_row("t", "dead", event_id=uuid7_at(now - timedelta(minutes=8)))
    insert_rows(engine, [delayed, behind, failed])
    acknowledge_all(engine)
    park(engine, delayed, "delayed", held=[behind], until_seconds=3600)
    park(engine, failed, "dead")
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT * FROM oncely_outbox ORDER BY seq")).all()
    retention.run(engine, POLICY, log_starts)
    assert len(_kept_ids(engine)) == 3
    with engine.connect() as conn:
        snapshot = conn.execute(sa.text(debezium.snapshot_statement("public"))).all()
    assert snapshot == [row for row in before if row.id != failed["id"]]
