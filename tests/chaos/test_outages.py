"""Outages of the broker and the database, rebalance storms, a long-held transaction (`make chaos`).

Each scenario runs real processes against real services, then the ledger checker proves 0 lost,
0 duplicate effects and per-key order; the printed line reports events, Kafka duplicates,
recovery time and (S12) peak memory.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.devstack import KafkaNode, PostgresNode
from oncely.storage import upgrade
from tests.apps.ledger import build, create_tables
from tests.chaos.harness import Pipeline, pipeline, unique_prefix
from tests.chaos.ledger import check
from tests.helpers import scalar

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def _report(name: str, chaos: Pipeline, recovery: float, **extra: object) -> None:
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    details = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{name} recovery={recovery:.1f}s {details} {chaos.peak_memory()} {report.summary()}")
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"


def _create_topic(bootstrap: str, topic: str) -> None:
    # A local client: one kept alive in a failed test's traceback would log for ever.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3)])[topic].result(30)


def test_s5_a_rebalance_storm_keeps_effects_single_and_ordered(chaos: Pipeline) -> None:
    chaos.relay().start()
    members = [chaos.consumer(name=f"ledger-{i}").start() for i in range(2)]
    writer = chaos.write_in_background(2000, keys=30)
    joins = 0
    while writer.is_alive():
        time.sleep(3)
        members.pop(0).kill(signal.SIGTERM)
        members.append(chaos.consumer(name=f"ledger-{joins + 2}").start())
        joins += 1
    started = time.monotonic()
    chaos.wait_applied(chaos.staged(), timeout=300)
    _report("S5", chaos, time.monotonic() - started, membership_changes=joins)


def test_s9_a_long_held_transaction_does_not_stop_the_pipeline(chaos: Pipeline) -> None:
    chaos.relay().start()
    chaos.consumer().start()
    blocker = psycopg.connect(chaos.engine.url.set(drivername="postgresql").render_as_string(False))
    blocker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    blocker.execute("SELECT count(*) FROM oncely_outbox")  # holds its snapshot (xmin)
    try:
        started = time.monotonic()
        chaos.write(500, keys=10)
        recovery = chaos.wait_applied(500, timeout=180)
        with chaos.engine.connect() as conn:
            # Commit to effect: the outbox keeps no publish time (rows are immutable).
            applied_ms = conn.execute(
                sa.text(
                    "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY"
                    " EXTRACT(EPOCH FROM l.applied_at - o.created_at) * 1000)"
                    " FROM chaos_outbox AS o JOIN ledger AS l ON l.event_id = o.id"
                )
            ).scalar_one()
    finally:
        blocker.rollback()
        blocker.close()
    _report(
        "S9",
        chaos,
        recovery,
        p99_commit_to_applied_ms=round(applied_ms or 0),
        wall=round(time.monotonic() - started),
    )


@contextmanager
def _own_broker(database_url: str, tmp_path: Path) -> Iterator[tuple[KafkaNode, Pipeline]]:
    """A broker of the test's own (the scenario kills or stops it) and a pipeline on it."""
    broker = KafkaNode(data_dir=tmp_path / "kafka")
    broker.start()
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    prefix = unique_prefix()
    app = build(prefix, group_prefix=prefix)
    _create_topic(broker.bootstrap_servers, app.topic)
    try:
        with pipeline(engine, database_url, broker.bootstrap_servers, app, tmp_path) as chaos:
            yield broker, chaos
    finally:
        broker.stop()
        engine.dispose()


def test_s6_broker_killed_and_paused_past_the_delivery_timeout(
    database_url: str, tmp_path: Path
) -> None:
    with _own_broker(database_url, tmp_path) as (broker, chaos):
        chaos.relay().start()
        chaos.consumer().start()
        writer = chaos.write_in_background(1500, keys=20)
        # Killed once events flow end to end, not while the consumer still starts (it exits
        # when it cannot create its dead-letter topics; a loaded machine took over 3 s to get
        # there).
        chaos.wait_applied(50)
        assert broker._proc is not None
        broker._proc.send_signal(signal.SIGKILL)
        broker._proc.wait()
        broker._proc = None
        time.sleep(5)
        broker.start()
        time.sleep(3)
        assert broker._proc is not None
        broker._proc.send_signal(signal.SIGSTOP)  # longer than message.timeout.ms (5 s)
        time.sleep(8)
        broker._proc.send_signal(signal.SIGCONT)
        writer.join()
        started = time.monotonic()
        chaos.wait_applied(chaos.staged(), timeout=300)
        _report("S6", chaos, time.monotonic() - started)


def test_s8_postgres_restart_and_terminated_connections(
    kafka_bootstrap: str, kafka_admin: Any, tmp_path: Path
) -> None:
    database = PostgresNode(data_dir=tmp_path / "pg")
    database.start()
    engine = sa.create_engine(database.url, pool_size=5, pool_pre_ping=True)
    upgrade(engine)
    create_tables(engine)
    prefix = unique_prefix()
    app = build(prefix, group_prefix=prefix)
    kafka_admin.create_topics([NewTopic(app.topic, num_partitions=3)])[app.topic].result(30)
    try:
        with pipeline(engine, database.url, kafka_bootstrap, app, tmp_path) as chaos:
            chaos.relay().start()
            chaos.consumer().start()
            chaos.write(300, keys=10)
            chaos.wait_applied(100, timeout=120)  # the relay and the consumer are connected
            killed = scalar(
                engine,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE pid <> pg_backend_pid() AND datname = current_database()",
            )
            assert killed >= 2, "the relay's and the consumer's connections were terminated"
            chaos.write(300, keys=10, seed=1)
            database.stop(immediate=True)  # every connection drops, crash recovery on start
            time.sleep(3)
            database.start()
            engine.dispose()
            chaos.write(300, keys=10, seed=2)
            started = time.monotonic()
            chaos.wait_applied(900, timeout=300)
            _report("S8", chaos, time.monotonic() - started, terminated=killed)
    finally:
        engine.dispose()
        database.stop()


def test_s12_broker_down_for_a_minute_under_load_keeps_memory_bounded(
    database_url: str, tmp_path: Path
) -> None:
    with _own_broker(database_url, tmp_path) as (broker, chaos):
        relay = chaos.relay().start()
        consumer = chaos.consumer().start()
        chaos.write(200, keys=50, seed=1)
        chaos.wait_applied(200)  # the relay runs and publishes
        before = relay.rss_mb()
        consumer_rss = [consumer.rss_mb()]
        broker.stop()
        outage = time.monotonic()
        stop = threading.Event()
        writer = chaos.write_until(stop, keys=50, pause=0)  # one writer, as fast as it goes
        rss, backlog = [before], [chaos.staged()]
        while time.monotonic() - outage < 60:
            time.sleep(5)
            assert relay.alive(), chaos.logs()
            rss.append(relay.rss_mb())
            consumer_rss.append(consumer.rss_mb())
            backlog.append(chaos.staged())
        stop.set()
        writer.join(60)
        end_of_outage = relay.rss_mb()
        peak = relay.peak_rss_mb()
        broker.start()
        started = time.monotonic()
        draining = threading.Event()

        def sample_consumer() -> None:  # the consumer works through the outage's backlog
            while not draining.wait(1.0):
                consumer_rss.append(consumer.rss_mb())

        sampler = threading.Thread(target=sample_consumer, daemon=True)
        sampler.start()
        chaos.wait_applied(chaos.staged(), timeout=300)
        draining.set()
        sampler.join(5)
        after = relay.rss_mb()
        _report(
            "S12",
            chaos,
            time.monotonic() - started,
            relay_rss_mb_before=int(before),
            relay_rss_mb_during="/".join(str(int(r)) for r in rss),
            outbox_rows_during="/".join(str(n) for n in backlog),
            relay_rss_mb_end_of_outage=int(end_of_outage),
            relay_rss_mb_after=int(after),
            relay_peak_rss_mb=int(peak),
            consumer_rss_mb_samples=f"{int(min(consumer_rss))}-{int(max(consumer_rss))}",
            consumer_peak_rss_mb=int(consumer.peak_rss_mb()),
        )
        # The relay holds at most max_in_flight records: the rows staged during the outage
        # stay in the outbox, not in its memory, however many delivery timeouts pass. Past the
        # first 20 s (max_in_flight rows read and produced) its memory stays flat while the
        # backlog keeps growing.
        assert backlog[-1] >= 1.5 * backlog[4], f"too little load to tell: {backlog}"
        assert rss[-1] - rss[4] < 32, f"relay RSS grew with the backlog: {rss} MiB, {backlog}"
        assert end_of_outage - before < 100, f"relay RSS grew {before:.0f} -> {end_of_outage:.0f}"
        assert after - before < 100, f"relay RSS grew {before:.0f} -> {after:.0f} MiB"
        assert peak < 512, f"relay peak RSS {peak:.0f} MiB"
