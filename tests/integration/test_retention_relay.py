"""The relay's purge timer on partitioned tables: it publishes an old partition's rows, then drops
the partition (``ONCELY_RETENTION_IN_RELAY`` true) or only plans (false), and exports the
``oncely_retention_*`` gauges either way; on unpartitioned tables the batched DELETE stays, and a
relay that was running when the tables were converted (``db upgrade --partition-every``) turns
to retention at its next run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa

from oncely.relay import Relay
from oncely.storage import partitions, upgrade
from tests.helpers import (
    count_published,
    fast_settings,
    insert_rows,
    outbox_row,
    read_committed,
    running_relay,
    scalar,
    uuid7_at,
    wait_until,
)

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)


def _sample(relay: Relay, name: str, **labels: str) -> float | None:
    return relay.metrics.registry.get_sample_value(name, labels)


def _old_partition_with_rows(engine: sa.Engine, topic: str) -> tuple[str, datetime]:
    """Partitioned by the minute, with rows of ten minutes ago: their partition's name and
    start."""
    upgrade(engine, partition_every=STEP)
    now: datetime = scalar(engine, "SELECT now()")
    moment = now - timedelta(minutes=10)
    start = partitions.window_start(moment, STEP)
    with engine.begin() as conn:
        partitions.create_partition(conn, "oncely_outbox", start, start + STEP)
    insert_rows(engine, [outbox_row(topic, f"k{i}", event_id=uuid7_at(moment)) for i in range(3)])
    return partitions.partition_name("oncely_outbox", start), start


def _exists(engine: sa.Engine, name: str) -> bool:
    return scalar(engine, "SELECT to_regclass(:n) IS NOT NULL", n=name) is True


def test_the_relay_drops_an_outbox_partition_once_it_has_published_its_rows(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    relay_mode: dict[str, object],
) -> None:
    caplog.set_level(logging.INFO, logger="oncely.relay.housekeeping")  # as `oncely relay run`
    topic = new_topic()
    name, start = _old_partition_with_rows(engine, topic)
    monkeypatch.setenv("ONCELY_RETENTION_RECEIPTS_HORIZON_SECONDS", "60")
    settings = fast_settings(retention_seconds=60, purge_interval_seconds=0.3, **relay_mode)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: not _exists(engine, name), timeout=60)
        assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 0  # gone with it
        assert len(read_committed(kafka_bootstrap, [topic])) == 3, "dropped once published"
        wait_until(
            lambda: (_sample(relay, "oncely_retention_partitions", table="oncely_outbox") or 0) > 0,
            timeout=10,
        )
    dropped = _sample(relay, "oncely_retention_dropped_partitions_total", table="oncely_outbox")
    assert dropped is not None and dropped >= 1
    for gauge in (
        "oncely_retention_bytes",
        "oncely_retention_oldest_timestamp_seconds",
        "oncely_retention_default_rows",
        "oncely_retention_blocked_seconds",
        "oncely_retention_kept_partitions",
    ):
        for table in ("oncely_outbox", "oncely_receipts"):
            assert _sample(relay, gauge, table=table) is not None, (gauge, table)
    assert _sample(relay, "oncely_retention_errors_total") == 0
    assert any(r.getMessage().startswith("retention: created") for r in caplog.records)
    oldest = _sample(relay, "oncely_retention_oldest_timestamp_seconds", table="oncely_outbox")
    assert oldest is not None and oldest > start.timestamp()


def test_a_relay_that_only_plans_keeps_the_partition_and_exports_the_gauges(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, _ = _old_partition_with_rows(engine, new_topic())
    monkeypatch.setenv("ONCELY_RETENTION_IN_RELAY", "false")
    settings = fast_settings(retention_seconds=60, purge_interval_seconds=0.3)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: count_published(engine) == 3, timeout=60)
        runs = relay.housekeeping.runs
        wait_until(lambda: relay.housekeeping.runs >= runs + 2, timeout=30)
        assert _exists(engine, name)
        assert (_sample(relay, "oncely_retention_partitions", table="oncely_outbox") or 0) > 0
    assert _sample(relay, "oncely_retention_dropped_partitions_total", table="oncely_outbox") == 0
    assert _exists(engine, name)


def test_on_unpartitioned_tables_the_relay_still_purges_by_batched_delete(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    topic = new_topic()
    insert_rows(engine, [outbox_row(topic, f"k{i}") for i in range(3)])
    settings = fast_settings(retention_seconds=0, purge_interval_seconds=0.3, **relay_mode)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM oncely_outbox") == 0, timeout=60)
        assert len(read_committed(kafka_bootstrap, [topic])) == 3, "purged once published"
    assert _sample(relay, "oncely_retention_partitions", table="oncely_outbox") is None


def test_a_relay_running_during_the_conversion_turns_to_retention_at_its_next_run(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The conversion creates the current step and 3 ahead; the relay keeps 6 ahead, so only a
    # relay that runs retention creates the steps after the conversion's.
    monkeypatch.setenv("ONCELY_RETENTION_AHEAD", "6")
    insert_rows(engine, [outbox_row(new_topic(), f"k{i}") for i in range(3)])
    settings = fast_settings(retention_seconds=3600, purge_interval_seconds=0.3)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: count_published(engine) == 3, timeout=60)
        runs = relay.housekeeping.runs
        wait_until(lambda: relay.housekeeping.runs >= runs + 1, timeout=30)  # unpartitioned
        assert _sample(relay, "oncely_retention_partitions", table="oncely_outbox") is None

        upgrade(engine, partition_every=STEP)  # oncely db upgrade --partition-every 1m
        with engine.connect() as conn:
            converted = {p.name for p in partitions.partitions(conn, "oncely_outbox")}
        now: datetime = scalar(engine, "SELECT now()")
        last = partitions.window_start(now, STEP) + 6 * STEP  # a run from now on creates it
        runs = relay.housekeeping.runs
        wait_until(lambda: relay.housekeeping.runs >= runs + 3, timeout=30)
        with engine.connect() as conn:
            names = {p.name for p in partitions.partitions(conn, "oncely_outbox")}
        assert partitions.partition_name("oncely_outbox", last) in names - converted, (
            f"no partition created ahead after the conversion: {sorted(names)}"
        )
        for table in ("oncely_outbox", "oncely_receipts"):
            assert (_sample(relay, "oncely_retention_partitions", table=table) or 0) > 0, table
            assert _sample(relay, "oncely_retention_default_rows", table=table) == 0, table
    assert _sample(relay, "oncely_retention_errors_total") == 0
