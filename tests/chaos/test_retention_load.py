"""Retention under load (`make chaos`; a soak of 1-3 minutes, moved out of `make test` in issue
46): the relay and a consumer run through partition drops with nothing lost and no effect
applied twice.

`make test` keeps shorter tests of the same guarantees: the fault scenarios of
``test_process_faults.py`` (relays and consumers exiting at each failpoint: nothing lost, no
effect applied twice) run on minute-partitioned tables with retention running every 3 s, which
drops a partition when a scenario crosses a minute boundary; the relay drops an outbox partition
once it has published its rows (``test_retention_relay.py``); the rows of a step moved out of
the default partition are published once (``test_retention_default.py``); each rule of the
guard (unpublished, dead and held rows keep an outbox partition: ``test_retention.py``; Kafka's
copies and the outbox's events keep a receipts partition: ``test_retention_kafka.py``) and the
drops' locks against staging (``test_retention_races.py``) have their own test.

The outbox and the receipts are partitioned by the minute, with horizons of 0 (a partition
may go as soon as its minute is over and the guard lets it go). A writer stages events in
business transactions without pause, a relay process publishes them, a consumer process applies
the ledger effect (its own table, one row per application, no unique constraint), retention runs
every two seconds, and Kafka deletes the records the consumer has committed (``delete_records``
up to the group's offsets, as ``retention.ms`` would), so receipts partitions can go too. The
relay is stopped across a minute boundary (another starts 14 s later), so a closed outbox
partition holds rows no relay has published when retention looks at it, and the consumer is
killed once and restarted, so records are delivered again after drops.

Staging also shows the drops' locks: each transaction waits at most ``lock_timeout`` for them
and none fails (a drop that locked the partition before its table deadlocked with staging).
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from sqlalchemy.orm import Session

from oncely import retention
from oncely.producer.staging import stage
from oncely.schemas.codec import Codec
from oncely.settings import RelaySettings, RetentionSettings
from tests.apps.ledger import App, create_tables
from tests.chaos.harness import Pipeline, pipeline

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(330)]

POLICY = retention.policy_of(
    RetentionSettings(ahead=2),
    RelaySettings(),
    outbox_horizon=timedelta(0),
    receipts_horizon=timedelta(0),
)
#: No relay runs for this long, from this many seconds before a minute boundary.
PAUSE, BEFORE_BOUNDARY = 14.0, 5.0
#: The load stops once this much of it ran past the paused boundary and drops were seen.
AFTER_PAUSE = 25.0
LOAD_CAP = 200.0


class Writer:
    """Stages one event per business transaction, back to back, until stopped; one in 15 is
    rolled back. Records each transaction's duration and any error."""

    def __init__(self, load: Pipeline) -> None:
        self.load = load
        self.codec = Codec(registry=load.app.registry)
        self.failures: list[str] = []
        self.slowest = 0.0
        self.transactions = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="writer")

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                with Session(self.load.engine) as session:
                    session.begin()
                    event = self.load.app.model(account_id=f"acc-{n % 40}", amount=n, n=n)
                    staged = stage(session, event, codec=self.codec)
                    if n % 15:
                        session.execute(
                            sa.text("INSERT INTO chaos_business VALUES (:e, true)"),
                            {"e": staged.id},
                        )
                        session.commit()
                    else:
                        session.rollback()
            except Exception as exc:  # a staging transaction that failed fails the test
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.transactions += 1
            time.sleep(0.01)


class Trimmer:
    """Deletes, every few seconds, the records the consumer group has committed (Kafka's
    ``retention.ms``, sped up): once deleted, a receipt of them can no longer be needed."""

    def __init__(
        self, admin: AdminClient, bootstrap: str, group: str, topic: str, partitions: int
    ) -> None:
        self.admin, self.bootstrap, self.group = admin, bootstrap, group
        self.topic, self.partitions = topic, partitions
        self.deleted: dict[int, int] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="trimmer")

    def _run(self) -> None:
        while not self.stop.wait(3.0):
            try:
                self.trim()
            except Exception as exc:  # reported; the drops asserted on show its effect
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def trim(self) -> None:
        reader = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group})
        try:
            asked = [TopicPartition(self.topic, n) for n in range(self.partitions)]
            committed = [
                tp
                for tp in reader.committed(asked, timeout=15)
                if tp.offset > self.deleted.get(tp.partition, 0)
            ]
        finally:
            reader.close()
        if not committed:
            return
        for tp, done in self.admin.delete_records(committed).items():
            done.result(timeout=15)
            self.deleted[tp.partition] = tp.offset


def _db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
    return now


def _wait(condition: Callable[[], bool], timeout: float) -> None:
    """Wait until ``condition`` holds or ``timeout`` passed (the checks after say what is
    missing)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url, pool_size=8)
    yield engine
    engine.dispose()


def test_relay_and_consumer_run_through_drops_under_load_with_nothing_lost_or_applied_twice(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    new_ledger: Callable[..., App],
    tmp_path: Path,
) -> None:
    app = new_ledger(2)
    create_tables(engine)
    started = time.monotonic()
    with pipeline(
        engine, database_url, kafka_bootstrap, app, tmp_path, policy=POLICY, retention_every=2.0
    ) as load:
        keeper = load.retention
        assert keeper is not None
        relay = load.relay().start()
        consumer = load.consumer().start()
        writer, trimmer = (
            Writer(load),
            Trimmer(kafka_admin, kafka_bootstrap, app.effects.group_id("ledger"), app.topic, 2),
        )
        writer.thread.start()
        trimmer.thread.start()

        # Stop the relay across the first minute boundary at least 15 s away, then start
        # another: the partition that closes meanwhile holds rows no relay has published (the
        # guard must keep it) and no transaction holds a lock retention would wait for.
        now = _db_now(engine)
        boundary = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
        if (boundary - now).total_seconds() < 15:
            boundary += timedelta(minutes=1)
        time.sleep((boundary - now).total_seconds() - BEFORE_BOUNDARY)
        relay.stop()
        time.sleep(PAUSE)
        relay = load.relay("relay-after").start()
        paused_until = time.monotonic()
        # A consumer killed after drops: its uncommitted records come again, to the receipts.
        time.sleep(4)
        consumer.kill(signal.SIGKILL)
        consumer = load.consumer(name="ledger-after").start()

        def enough() -> bool:
            return (
                time.monotonic() - paused_until >= AFTER_PAUSE
                and len(keeper.dropped_of("oncely_outbox")) >= 2
                and len(keeper.dropped_of("oncely_receipts")) >= 1
            )

        while not enough() and time.monotonic() - started < LOAD_CAP:
            time.sleep(1)
        dropped_under_load = list(keeper.dropped)
        assert relay.alive() and consumer.alive(), load.logs()
        writer.stop.set()
        writer.thread.join(30)
        load_seconds = time.monotonic() - started

        committed = load.staged()
        applied = "SELECT count(DISTINCT event_id) FROM ledger WHERE effect = 'ledger'"
        _wait(lambda: load.count(applied) >= committed, 120)
        trimmer.stop.set()
        trimmer.thread.join(30)

        with engine.connect() as conn:
            staged = {
                str(i) for i in conn.execute(sa.text("SELECT id FROM chaos_outbox")).scalars()
            }
            business = {
                str(event_id): ok
                for event_id, ok in conn.execute(
                    sa.text("SELECT event_id, committed FROM chaos_business")
                )
            }
            effects = Counter(
                str(row[0])
                for row in conn.execute(
                    sa.text("SELECT event_id FROM ledger WHERE effect = 'ledger'")
                )
            )
            twice_receipted = conn.execute(
                sa.text(
                    "SELECT count(*) FROM (SELECT 1 FROM oncely_receipts"
                    " GROUP BY event_id, effect HAVING count(*) > 1) AS d"
                )
            ).scalar_one()
        published = load.published()

    outbox_dropped = [n for n in dropped_under_load if n.startswith("oncely_outbox_p")]
    receipts_dropped = [n for n in dropped_under_load if n.startswith("oncely_receipts_p")]
    print(
        f"retention load: {load_seconds:.0f} s of load, {writer.transactions} staging "
        f"transactions (slowest {writer.slowest:.2f} s), {len(staged)} events staged, "
        f"dropped under load: {len(outbox_dropped)} outbox {outbox_dropped}, "
        f"{len(receipts_dropped)} receipts {receipts_dropped}; {keeper.summary()}; "
        f"deleted up to {trimmer.deleted}"
    )
    assert not writer.failures, writer.failures
    assert outbox_dropped, f"no outbox partition dropped under load: {keeper.summary()}"
    assert receipts_dropped, (
        f"no receipts partition dropped under load: {keeper.summary()} {trimmer.errors}"
    )
    # Nothing lost: every committed transaction's event was staged, published and applied.
    assert staged == {e for e, ok in business.items() if ok}
    missing = staged - set(effects)
    assert not missing, (
        f"{len(missing)} staged events never applied (lost), e.g. {sorted(missing)[:3]}"
    )
    assert published == len(staged)
    # No effect applied twice, none of a rolled-back transaction, receipts unique.
    twice = {e: n for e, n in effects.items() if n > 1}
    assert not twice, f"{len(twice)} effects applied more than once, e.g. {list(twice.items())[:3]}"
    assert set(effects) <= staged
    assert twice_receipted == 0
    # Staging waited for a drop's locks at most lock_timeout (and never failed on them).
    assert writer.slowest < POLICY.lock_timeout + 3, writer.slowest
