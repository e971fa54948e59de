"""The default partitions against real PostgreSQL (and Kafka where the guard or the relay needs
it): a partition whose range has rows in the default partition is created with those rows
moved into it (every column, the idempotency keys and the relay's progress intact, nothing
streamed again); outbox rows that no range will take are deleted once the relay has passed
them and they are past the horizon, so the receipts partitions they held go; a creation error
does not stop the rest of a run; a step the Python API is given is checked as the CLI's."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from oncely import retention
from oncely.debezium.connector import ConnectorOptions, connector_config
from oncely.errors import ConfigurationError
from oncely.relay.housekeeping import Housekeeping
from oncely.runtime.metrics import RetentionMetrics
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import outbox as outbox_table
from oncely.storage import partitions, upgrade
from oncely.storage.stores.outbox.relay import RelayStore
from tests.helpers import (
    acknowledge_all,
    execute,
    fast_settings,
    insert_rows,
    outbox_row,
    park,
    partitioned_by_minute,
    query_all,
    query_one,
    read_topics,
    running_relay,
    scalar,
    uuid7_at,
    wait_until,
)

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)
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


def _name(table: str, moment: datetime) -> str:
    return partitions.partition_name(table, partitions.window_start(moment, STEP))


def _exists(engine: sa.Engine, name: str) -> bool:
    return scalar(engine, "SELECT to_regclass(:n)", n=name) is not None


def _where(engine: sa.Engine, event_id: object) -> str | None:
    """The partition that holds the outbox row ``event_id`` (``None``: none does)."""
    rows = query_all(
        engine, "SELECT tableoid::regclass::text AS p FROM oncely_outbox WHERE id = :i", i=event_id
    )
    return str(rows[0].p) if rows else None


def _keys(engine: sa.Engine, key: str) -> list[object]:
    """The event ids ``oncely_outbox_keys`` holds for the idempotency key ``key``."""
    rows = query_all(engine, "SELECT event_id FROM oncely_outbox_keys WHERE event_key = :k", k=key)
    return [row.event_id for row in rows]


def _keyed(topic: str, moment: datetime, key: str) -> dict[str, object]:
    """A row of ``moment`` whose aggregate and idempotency key are ``key``."""
    return outbox_row(topic, key, event_id=uuid7_at(moment), event_key=key)


def test_outbox_default_rows_passed_and_past_the_horizon_go_and_the_receipts_follow(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    # The outbox partitions of 15 to 5 minutes ago were dropped; rows of their ranges came
    # later (a client clock behind): they are in the default partition.
    for minutes in range(5, 16):
        execute(engine, f"DROP TABLE {_name('oncely_outbox', now - timedelta(minutes=minutes))}")
    old = {
        name: _keyed("t", now - timedelta(minutes=minutes), f"key-{name}")
        for name, minutes in [("passed", 15), ("unpassed", 12), ("parked", 10), ("recent", 8)]
    }
    insert_rows(engine, [old["passed"], old["parked"], old["recent"]])
    acknowledge_all(engine)
    park(engine, old["parked"], "dead")
    insert_rows(engine, [old["unpassed"]])
    # created_at is the database's clock: every row but "recent" was staged 5 minutes ago.
    execute(
        engine,
        "UPDATE oncely_outbox SET created_at = now() - interval '5 minutes' WHERE id <> :i",
        i=old["recent"]["id"],
    )
    for row in old.values():
        assert _where(engine, row["id"]) == "oncely_outbox_default"
    # A receipt of the passed row's event, in its receipts partition, read from a topic
    # deleted since (Kafka holds none of its records).
    execute(
        engine,
        'INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset")'
        " VALUES (:e, 'x', :t, 0, 0)",
        e=old["passed"]["id"],
        t=f"deleted-{uuid4().hex}",
    )
    held = _name("oncely_receipts", now - timedelta(minutes=15))
    later = _name("oncely_receipts", now - timedelta(minutes=14))
    policy = retention.policy_of(
        RetentionSettings(ahead=2),
        RelaySettings(),
        outbox_horizon=timedelta(minutes=2),
        receipts_horizon=STEP,
    )

    outcome = retention.run(engine, policy, log_starts)
    assert not outcome.errors, outcome.errors
    kept = {v.partition.name: v.reason for v in retention.run(engine, policy, log_starts).kept}
    assert held not in kept, kept[held]
    assert later not in kept, kept[later]
    assert not _exists(engine, held) and not _exists(engine, later)
    # The passed row and its key are gone; the others stay, each for its reason.
    assert _where(engine, old["passed"]["id"]) is None
    assert _keys(engine, "key-passed") == []
    for name in ("unpassed", "parked", "recent"):
        assert _where(engine, old[name]["id"]) == "oncely_outbox_default", name
        assert _keys(engine, f"key-{name}") == [old[name]["id"]]
    # The receipts partition of the unpassed row's range is kept, naming where its event is.
    reason = kept[_name("oncely_receipts", now - timedelta(minutes=12))]
    assert "oncely_outbox_default" in str(reason), reason


def test_outbox_default_row_holds_its_receipts_partition_naming_the_default_partition(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    moment = now - timedelta(minutes=10)
    execute(engine, f"DROP TABLE {_name('oncely_outbox', moment)}")
    insert_rows(engine, [outbox_row("t", event_id=uuid7_at(moment))])
    plan = retention.plan(engine, POLICY, log_starts)
    reasons = {v.partition.name: v.reason for v in plan.verdicts}
    reason = str(reasons[_name("oncely_receipts", moment)])
    assert "oncely_outbox_default" in reason, reason


def test_a_step_with_default_rows_is_created_with_them_moved_and_the_relay_publishes_each_once(
    engine: sa.Engine,
    now: datetime,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    log_starts: retention.maintenance.AskKafka,
) -> None:
    topic = new_topic(partitions=3)
    current = [_keyed(topic, now, f"current-{i}") for i in range(3)]
    # Staged 10 minutes ahead (a client clock ahead, or no partition created ahead): beyond
    # the partitions created, in the default partition, outbox and receipts alike.
    ahead = [_keyed(topic, now + timedelta(minutes=10), f"ahead-{i}") for i in range(3)]
    insert_rows(engine, current + ahead)
    execute(
        engine,
        "INSERT INTO oncely_receipts (event_id, effect) VALUES (:e, 'x')",
        e=ahead[0]["id"],
    )
    before = {
        row.id: row
        for row in (
            query_one(
                engine,
                "SELECT id, seq, txid::text AS txid, shard, created_at, event_key, payload"
                " FROM oncely_outbox WHERE id = :i",
                i=r["id"],
            )
            for r in ahead
        )
    }
    assert {_where(engine, r["id"]) for r in ahead} == {"oncely_outbox_default"}

    outcome = retention.run(
        engine, retention.policy_of(RetentionSettings(ahead=12), RelaySettings()), log_starts
    )
    assert not outcome.errors, outcome.errors
    name = _name("oncely_outbox", now + timedelta(minutes=10))
    assert name in outcome.created
    assert _name("oncely_receipts", now + timedelta(minutes=10)) in outcome.created
    for row in ahead:
        assert _where(engine, row["id"]) == name
        moved = query_one(
            engine,
            "SELECT id, seq, txid::text AS txid, shard, created_at, event_key, payload"
            " FROM oncely_outbox WHERE id = :i",
            i=row["id"],
        )
        assert moved == before[row["id"]]
        assert _keys(engine, str(row["event_key"])) == [row["id"]]
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox_default") == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts_default") == 0
    assert scalar(
        engine,
        "SELECT tableoid::regclass::text FROM oncely_receipts WHERE event_id = :e",
        e=ahead[0]["id"],
    ) == _name("oncely_receipts", now + timedelta(minutes=10))
    # The key still refuses a second row, the moved partition takes new rows of its range.
    with pytest.raises(sa.exc.IntegrityError):
        insert_rows(engine, [_keyed(topic, now, "ahead-0")])
    later = [_keyed(topic, now + timedelta(minutes=10), "later-0")]
    insert_rows(engine, later)
    assert _where(engine, later[0]["id"]) == name

    # Rows published from the default partition, then moved: not published again.
    published = [_keyed(topic, now + timedelta(minutes=14), f"published-{i}") for i in range(3)]
    insert_rows(engine, published)
    every = current + ahead + later + published
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: len(read_topics(kafka_bootstrap, [topic])) >= len(every), timeout=60)
        assert {_where(engine, r["id"]) for r in published} == {"oncely_outbox_default"}
        outcome = retention.run(
            engine, retention.policy_of(RetentionSettings(ahead=16), RelaySettings()), log_starts
        )
        assert not outcome.errors, outcome.errors
        assert {_where(engine, r["id"]) for r in published} == {
            _name("oncely_outbox", now + timedelta(minutes=14))
        }
        time.sleep(2.0)  # a relay that would publish moved rows again has had the time to
    copies = Counter(r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic]))
    assert copies == Counter(str(row["id"]) for row in every)


def test_a_move_streams_nothing_to_a_debezium_publication(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    """Debezium's publication (``publish = 'insert'``, via the root) streams the rows when they
    are staged, and nothing when they move into their partition. A publication of every
    operation streams the move's deletes (as the purges'), as ``oncely_outbox``'s: oncely's
    connector skips deletes (``skipped.operations``)."""
    execute(
        engine,
        "CREATE PUBLICATION oncely_test_pub FOR TABLE oncely_outbox"
        " WITH (publish = 'insert', publish_via_partition_root = true)",
    )
    execute(
        engine,
        "CREATE PUBLICATION oncely_test_all FOR TABLE oncely_outbox"
        " WITH (publish_via_partition_root = true)",
    )
    execute(engine, "SELECT pg_create_logical_replication_slot('oncely_test_slot', 'pgoutput')")
    try:
        rows = [outbox_row("t", event_id=uuid7_at(now + timedelta(minutes=10))) for _ in range(3)]
        insert_rows(engine, rows)
        assert _changes(engine, "oncely_test_pub") == {"I": 3}
        outcome = retention.run(
            engine, retention.policy_of(RetentionSettings(ahead=12), RelaySettings()), log_starts
        )
        assert not outcome.errors, outcome.errors
        assert _where(engine, rows[0]["id"]) == _name("oncely_outbox", now + timedelta(minutes=10))
        assert _changes(engine, "oncely_test_pub") == {"I": 3}
        assert _changes(engine, "oncely_test_all") == {"I": 3, "D": 3}
    finally:
        execute(engine, "SELECT pg_drop_replication_slot('oncely_test_slot')")
    config = connector_config(ConnectorOptions(hostname="db", user="u", dbname="d"))
    assert "d" in config["skipped.operations"].split(",")


def _changes(engine: sa.Engine, publication: str) -> dict[str, int]:
    """Inserts (``I``) and deletes (``D``) the slot would stream to ``publication``'s
    subscriber (pgoutput's messages), read without consuming."""
    rows = query_all(
        engine,
        "SELECT substr(data, 1, 1) AS kind, count(*) AS n FROM"
        " pg_logical_slot_peek_binary_changes('oncely_test_slot', NULL, NULL,"
        " 'proto_version', '1', 'publication_names', :p)"
        " WHERE substr(data, 1, 1) IN ('I'::bytea, 'D'::bytea) GROUP BY 1",
        p=publication,
    )
    return {bytes(row.kind).decode(): int(row.n) for row in rows}


def test_a_creation_error_is_reported_and_the_run_goes_on(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    # A type holds the name of a partition to create (its table's row type cannot be made).
    blocked = _name("oncely_outbox", now + timedelta(minutes=5))
    execute(engine, f"CREATE TYPE {blocked} AS ENUM ('x')")
    row = outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=10)))
    insert_rows(engine, [row])
    acknowledge_all(engine)
    outcome = retention.run(
        engine,
        retention.policy_of(RetentionSettings(ahead=7), RelaySettings(), outbox_horizon=STEP),
        log_starts,
    )
    assert any(blocked in error for error in outcome.errors), outcome.errors
    assert _name("oncely_outbox", now + timedelta(minutes=6)) in outcome.created
    assert _name("oncely_receipts", now + timedelta(minutes=5)) in outcome.created
    assert _name("oncely_outbox", now - timedelta(minutes=10)) in outcome.dropped


def test_the_python_api_refuses_a_step_the_cli_refuses(engine: sa.Engine) -> None:
    with pytest.raises(ConfigurationError, match="partition step"):
        upgrade(engine, partition_every=timedelta(seconds=90.5))
    with engine.connect() as conn:
        assert partitions.step_of(conn) is None
    upgrade(engine, partition_every=timedelta(minutes=15))
    with engine.connect() as conn:
        assert partitions.step_of(conn) == timedelta(minutes=15)


def test_a_run_refuses_an_ahead_that_does_not_cover_its_interval(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    short = retention.policy_of(
        RetentionSettings(ahead=3), RelaySettings(), interval=timedelta(minutes=3)
    )
    with pytest.raises(ConfigurationError, match="ONCELY_RETENTION_AHEAD"):
        retention.run(engine, short, log_starts)
    covered = retention.policy_of(
        RetentionSettings(ahead=4), RelaySettings(), interval=timedelta(minutes=3)
    )
    assert not retention.run(engine, covered, log_starts).errors


def test_default_rows_are_counted_before_any_analyze(
    engine: sa.Engine, now: datetime, log_starts: retention.maintenance.AskKafka
) -> None:
    insert_rows(engine, [outbox_row("t", event_id=UUID(int=(1 << 80) + n)) for n in range(5)])

    def counted() -> int:
        states = {s.table: s for s in retention.states(engine, POLICY)}
        return states["oncely_outbox"].default_rows

    wait_until(lambda: counted() == 5, timeout=30)


def test_staging_into_other_partitions_goes_on_while_a_partition_is_created(
    engine: sa.Engine, now: datetime
) -> None:
    """A creation holds the outbox in SHARE UPDATE EXCLUSIVE mode only: a row of an existing
    partition is staged meanwhile; a row the default partition takes waits for the creation."""
    ahead = outbox_row("t", event_id=uuid7_at(now + timedelta(minutes=10)))
    insert_rows(engine, [ahead])
    with engine.connect() as creating:
        start = partitions.window_start(now + timedelta(minutes=10), STEP)
        partitions.create_partition(creating, "oncely_outbox", start, start + STEP)
        with engine.begin() as staging:
            staging.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            staging.execute(sa.insert(outbox_table), [outbox_row("t", event_id=uuid7_at(now))])
        far = outbox_row("t", event_id=uuid7_at(now + timedelta(minutes=30)))
        with engine.connect() as late:
            late.execute(sa.text("SET LOCAL lock_timeout = '500ms'"))
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
                late.execute(sa.insert(outbox_table), [far])
        creating.commit()
    assert _where(engine, ahead["id"]) == _name("oncely_outbox", now + timedelta(minutes=10))


def test_a_relay_whose_purge_interval_outlasts_its_partitions_ahead_refuses_and_counts_it(
    engine: sa.Engine, now: datetime, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    housekeeping = Housekeeping(
        store=RelayStore(engine, owner="test"),
        settings=RelaySettings(purge_interval_seconds=600),  # 3 partitions of 1m ahead: short
        retention_settings=RetentionSettings(ahead=3),
        kafka={},
        metrics=RetentionMetrics(registry),
    )
    with caplog.at_level(logging.WARNING, logger="oncely.relay.housekeeping"):
        housekeeping.due()
        housekeeping.join(30)
    assert registry.get_sample_value("oncely_retention_errors_total") == 1
    assert "set ONCELY_RETENTION_AHEAD to 11 or more" in caplog.text
    assert not _exists(engine, _name("oncely_outbox", now + timedelta(minutes=5)))
