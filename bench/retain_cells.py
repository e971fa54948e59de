"""R-RETAIN: retention of the time-partitioned outbox and receipts under a steady load, and what
partitioning costs the relay's drain and ``stage()``.

Two databases on the run's PostgreSQL server, side by side: ``partitioned`` (``upgrade(...,
partition_every=1 minute)``) and ``unpartitioned`` (the plain tables).

**Soak** (both databases at once, ``seconds`` long): per database, 2 writer threads commit one
outbox row per transaction open loop at ``rate`` events/s (each row's id a UUIDv7 taken when it is
written, as ``stage()`` makes them; a transaction that fails, a deadlock victim of a partition
drop, is counted and retried with a new row), an ``oncely relay
run`` process relays them to a topic with ``retention.ms`` 60 s and ``segment.ms`` 10 s, and an
``oncely consume`` process applies them with receipts (the ``apply`` effect of
:mod:`bench.effects_app`). On the partitioned database, :func:`oncely.retention.run` runs every
``RETENTION_EVERY`` seconds (outbox horizon 1 minute, receipts horizon 2 minutes); on the
unpartitioned one, the relay purges published rows every 20 s (rows older than 60 s) and
:func:`oncely.storage.stores.receipts.purge` deletes receipts older than 120 s every 20 s (the
batched DELETEs). Every ``SAMPLE_EVERY`` seconds: each table's size on disk
(``pg_total_relation_size``, summed over the partitions), its partitions and its ``n_dead_tup``
(``pg_stat_user_tables``, summed over the partitions). Reported: each table's size from its
first drop (or purge) onward, max/min and the mean of the last third over the first third;
``n_dead_tup`` max; the partitions dropped; and whether every staged event was applied exactly
once (the effect rows, which nothing deletes, against the ids the writers committed; the
receipts themselves are dropped by retention).

Receipts partitions only go once Kafka has deleted what they receipted: the broker must check
retention often (``log.retention.check.interval.ms``, 5 minutes by default, is a broker
setting). :func:`short_retention_checks` makes the devstack's broker check every 5 s.

**Side by side** (interleaved, ``repetitions`` times): the relay's drain (``rows`` rows with
UUIDv7 ids committed at once, the R1 relay side's measurement) and R5's business transaction +
``stage()`` (one statement; 8 concurrent writers), partitioned / unpartitioned; target within
5% (>= 0.95).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any
from unittest import mock

import psycopg
import sqlalchemy as sa
from confluent_kafka.admin import NewTopic
from psycopg.types.json import Jsonb

from bench import stage
from bench.effects_app import create_effects_table
from bench.fixtures import (
    Bench,
    Topics,
    Writes,
    processes,
    relay_processes,
    restage,
    sentinel,
    staged_rows,
    wait_ready,
)
from bench.harness import Cell, cpu_window, interleave, open_loop, progress
from bench.writers import outbox_rows
from oncely import retention
from oncely.devstack.kafka import KafkaNodeConfig
from oncely.ids import uuid7
from oncely.storage import outbox, upgrade
from oncely.storage import partitions as parts
from oncely.storage.stores import receipts
from oncely.testing.services import libpq_dsn

PARTITIONED, FLAT = "partitioned", "unpartitioned"
TABLES = ("oncely_outbox", "oncely_receipts")
STEP = timedelta(minutes=1)
POLICY = retention.Policy(
    outbox_horizon=timedelta(minutes=1),
    receipts_horizon=timedelta(minutes=2),
    ahead=3,
    lock_timeout=2.0,
)
#: The soak topics: Kafka deletes records after a minute, in segments rolled every 10 s.
TOPIC_CONFIG = {"retention.ms": "60000", "segment.ms": "10000", "segment.bytes": "1048576"}
#: How often retention (or the unpartitioned receipts purge) runs, and how often sizes are read.
RETENTION_EVERY, SAMPLE_EVERY = 20.0, 15.0
#: The unpartitioned database's batched DELETEs: the relay's purge and the receipts purge.
RELAY_PURGE = {"ONCELY_RELAY_PURGE_INTERVAL_SECONDS": "20", "ONCELY_RELAY_RETENTION_SECONDS": "60"}
RECEIPTS_OLDER_THAN = 120.0
WRITERS = 2


@contextlib.contextmanager
def short_retention_checks(interval_ms: int = 5000) -> Iterator[None]:
    """Devstack brokers started in the block check log retention every ``interval_ms``
    (``log.retention.check.interval.ms``, a broker setting no topic can override)."""
    original = KafkaNodeConfig.server_properties

    def properties(self: KafkaNodeConfig) -> str:
        return original(self) + f"log.retention.check.interval.ms={interval_ms}\n"

    with mock.patch.object(KafkaNodeConfig, "server_properties", properties):
        yield


# -- the two databases -------------------------------------------------------------------------


def _database(bench: Bench, name: str, *, partitioned: bool) -> Bench:
    """A fresh database ``name`` on the run's server, upgraded (partitioned by minute or not),
    with the effects table and R5's business tables; a Bench on it."""
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = sa.make_url(bench.database_url).set(database=name).render_as_string(hide_password=False)
    engine = sa.create_engine(url, pool_size=stage.WRITERS + 2)
    upgrade(engine, partition_every=STEP if partitioned else None)
    create_effects_table(engine)
    stage.create_business_tables(engine)
    return Bench(
        engine=engine,
        database_url=url,
        bootstrap=bench.bootstrap,
        rows=bench.rows,
        keys=bench.keys,
        batch_size=bench.batch_size,
        partitions=bench.partitions,
    )


def _drop_database(bench: Bench, db: Bench) -> None:
    db.engine.dispose()
    name = sa.make_url(db.database_url).database
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


# -- the soak ----------------------------------------------------------------------------------


class _FreshRows(Sequence[dict[str, Any]]):
    """``count`` outbox rows over the templates' keys, each built when the writer takes it: a
    UUIDv7 id of that moment (so it lands in the partition of now) and a fresh event key."""

    def __init__(self, templates: list[dict[str, Any]], count: int) -> None:
        self.templates, self.count = templates, count
        self.ids: dict[int, uuid.UUID] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        row = {
            **self.templates[i % len(self.templates)],
            "id": uuid7(),
            "event_key": uuid.uuid4().hex,
        }
        self.ids[i] = row["id"]
        return row


@contextlib.contextmanager
def _writers(database_url: str, rows: _FreshRows, failed: dict[str, int]) -> Iterator[Writes]:
    """:func:`bench.fixtures.outbox_writers`, but a transaction that fails (a deadlock victim
    of a partition drop, say) is counted in ``failed`` by error class and retried with a new
    row (a new id and key), as an application retries it."""
    connections = [
        psycopg.connect(libpq_dsn(database_url), autocommit=True) for _ in range(WRITERS)
    ]
    columns = list(rows.templates[0])
    insert = (
        f"INSERT INTO oncely_outbox ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))})"
    )
    writes = Writes([], [0.0] * len(rows), [0.0] * len(rows))

    def writer(conn: psycopg.Connection[Any]) -> Callable[[int, float], None]:
        def write(i: int, due_at: float) -> None:
            writes.due[i] = due_at
            for _ in range(100):
                row = rows[i]
                values = [Jsonb(row[c]) if c == "headers" else row[c] for c in columns]
                try:
                    conn.execute(insert, values, prepare=True)
                    break
                except psycopg.Error as exc:
                    kind = type(exc).__name__
                    failed[kind] = failed.get(kind, 0) + 1
            writes.committed[i] = time.time()

        return write

    writes.writers = [writer(conn) for conn in connections]
    writes.run = lambda rate, seconds: open_loop(rate, seconds, writes.writers)
    try:
        yield writes
    finally:
        for conn in connections:
            conn.close()


def _sample(db: Bench, partitioned: bool) -> dict[str, Any]:
    """Each table's bytes, partitions, n_dead_tup, n_live_tup and n_tup_del now."""
    out: dict[str, Any] = {}
    with db.engine.connect() as conn:
        for table in TABLES:
            if partitioned:
                found = parts.partitions(conn, table)
                size, count = sum(p.bytes for p in found), sum(1 for p in found if not p.is_default)
            else:
                size = int(
                    conn.execute(
                        sa.text("SELECT pg_total_relation_size(:t)"), {"t": table}
                    ).scalar_one()
                )
                count = 0
            dead, live, deleted = conn.execute(
                sa.text(
                    "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_live_tup), 0),"
                    " coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables"
                    " WHERE relid = to_regclass(:t)"
                    " OR relid IN (SELECT inhrelid FROM pg_inherits"
                    " WHERE inhparent = to_regclass(:t))"
                ),
                {"t": table},
            ).one()
            out[table] = {
                "bytes": size,
                "partitions": count,
                "n_dead_tup": int(dead),
                "n_live_tup": int(live),
                "n_tup_del": int(deleted),
            }
        if partitioned:
            keys_bytes, keys_dead = conn.execute(
                sa.text(
                    "SELECT pg_total_relation_size(relid), n_dead_tup FROM pg_stat_user_tables"
                    " WHERE relid = to_regclass(:t)"
                ),
                {"t": parts.KEYS_TABLE},
            ).one()
            out[parts.KEYS_TABLE] = {"bytes": int(keys_bytes), "n_dead_tup": int(keys_dead)}
    return out


class _Soak:
    """One database's soak: writers, relay, consumer, retention (or purges) and samples."""

    def __init__(self, bench: Bench, db: Bench, name: str, *, rate: float, seconds: float) -> None:
        self.bench, self.db, self.name = bench, db, name
        self.partitioned = name == PARTITIONED
        self.rate, self.seconds = rate, seconds
        self.prefix = f"rretain-{'p' if self.partitioned else 'u'}-{uuid.uuid4().hex[:6]}."
        self.samples: list[dict[str, Any]] = []
        self.drops: list[tuple[float, str]] = []
        self.purged: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.kept: list[str] = []
        #: Staging transactions that failed (deadlock victims, ...), by error class; retried.
        self.failed: dict[str, int] = {}
        #: Drops refused at drop time (a lock not granted, a deadlock victim).
        self.refused: list[str] = []
        self.logs: dict[str, Any] = {}
        self.started = 0.0

    def topic(self) -> str:
        templates = outbox_rows(self.prefix, self.bench.keys, keys=self.bench.keys)
        self.templates = templates
        name = str(templates[0]["topic"])
        admin = self.bench.admin()
        new = NewTopic(name, num_partitions=self.bench.partitions, config=TOPIC_CONFIG)
        admin.create_topics([new])[name].result(30)
        return name

    def maintain(self, stop: threading.Event) -> None:
        """Retention (partitioned) or the receipts purge (unpartitioned) every RETENTION_EVERY."""
        bootstrap = self.bench.bootstrap

        def starts(wanted: Any) -> Any:
            return retention.log_starts({"bootstrap.servers": bootstrap}, wanted, timeout=15)

        while not stop.wait(RETENTION_EVERY):
            now = time.monotonic() - self.started
            try:
                if self.partitioned:
                    outcome = retention.run(self.db.engine, POLICY, starts)
                    self.drops += [(now, name) for name in outcome.dropped]
                    self.errors += outcome.errors
                    self.kept = [f"{v.partition.name}: {v.reason}" for v in outcome.kept]
                    self.refused += [
                        f"{now:.0f} s {v.partition.name}: {v.reason}"
                        for v in outcome.kept
                        if v.reason and ("lock" in v.reason or "deadlock" in v.reason)
                    ]
                else:
                    n = receipts.purge(
                        self.db.engine,
                        effect="apply",
                        older_than_seconds=RECEIPTS_OLDER_THAN,
                        batch_size=5000,
                    )
                    self.purged.append((now, n))
            except Exception as exc:  # reported, the soak goes on
                self.errors.append(f"{now:.0f} s: {type(exc).__name__}: {exc}")

    def sample(self, stop: threading.Event) -> None:
        while True:
            self.samples.append(
                {
                    "t": round(time.monotonic() - self.started, 1),
                    **_sample(self.db, self.partitioned),
                }
            )
            if stop.wait(SAMPLE_EVERY):
                return

    def run(self) -> None:
        """The whole soak of this database (call on a thread of its own)."""
        self.topic_name = self.topic()
        env = {
            "ONCELY_DATABASE_URL": self.db.database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": self.bench.bootstrap,
            "ONCELY_BENCH_TOPIC_PREFIX": self.prefix,
            "ONCELY_BENCH_GROUP_PREFIX": self.prefix,
        }
        rows = _FreshRows(self.templates, int(self.rate * self.seconds))
        argv = ["consume", "bench.effects_app:effects", "--effect", "apply"]
        stop = threading.Event()
        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(
                relay_processes(self.db, 1, env={} if self.partitioned else RELAY_PURGE)
            )
            consumer = stack.enter_context(processes(argv, 1, env))
            self.logs = {"relay": relay[0].log, "consumer": consumer[0].log}
            wait_ready(consumer)
            writes = stack.enter_context(_writers(self.db.database_url, rows, self.failed))
            self.started = time.monotonic()
            threads = [
                threading.Thread(target=self.maintain, args=(stop,), daemon=True),
                threading.Thread(target=self.sample, args=(stop,), daemon=True),
            ]
            for thread in threads:
                thread.start()
            try:
                writes.run(self.rate, self.seconds)
                self.achieved = writes.achieved_rate()
                self.applied = self._wait_applied(len(rows), timeout=180)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(120)
        self.samples.append(
            {"t": round(time.monotonic() - self.started, 1), **_sample(self.db, self.partitioned)}
        )
        self.ids = [str(rows.ids[i]) for i in range(len(rows)) if i in rows.ids]
        self.check = self._check()

    def _wait_applied(self, count: int, *, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with self.db.engine.connect() as conn:
                n = int(conn.execute(sa.text("SELECT count(*) FROM bench_effects")).scalar_one())
            if n >= count or time.monotonic() > deadline:
                return n
            time.sleep(1)

    def _check(self) -> dict[str, Any]:
        """Every committed id applied exactly once: effect rows against the writers' ids."""
        with self.db.engine.connect() as conn:
            rows, distinct = conn.execute(
                sa.text("SELECT count(*), count(DISTINCT event_id) FROM bench_effects")
            ).one()
            applied = {
                str(i)
                for i in conn.execute(sa.text("SELECT event_id FROM bench_effects")).scalars()
            }
            left = int(conn.execute(sa.text("SELECT count(*) FROM oncely_receipts")).scalar_one())
        staged = set(self.ids)
        return {
            "staged": len(self.ids),
            "effect_rows": int(rows),
            "distinct_applied": int(distinct),
            "missing": len(staged - applied),
            "unexpected": len(applied - staged),
            "receipts_left": left,
            "exactly_once": int(rows) == int(distinct) == len(staged) and staged == applied,
        }

    def report(self) -> dict[str, Any]:
        tables = {}
        for table in TABLES:
            first = self._first_removal(table)
            after = [s for s in self.samples if first is not None and s["t"] >= first]
            sizes = [s[table]["bytes"] for s in after]
            third = max(1, len(sizes) // 3)
            tables[table] = {
                "first_removal_s": first,
                "bytes_from_first_removal": sizes,
                "max_over_min": round(max(sizes) / min(sizes), 2) if sizes else None,
                "last_third_over_first_third": round(
                    statistics.mean(sizes[-third:]) / statistics.mean(sizes[:third]), 2
                )
                if len(sizes) >= 3
                else None,
                "n_dead_tup_max": max(s[table]["n_dead_tup"] for s in self.samples),
                "n_dead_tup_max_from_first_removal": max(
                    (s[table]["n_dead_tup"] for s in after), default=None
                ),
                "bytes_max": max(s[table]["bytes"] for s in self.samples),
                "partitions_dropped": sum(1 for _, n in self.drops if n.startswith(table + "_p")),
                "partitions_at_end": self.samples[-1][table]["partitions"],
                "rows_deleted": self.samples[-1][table]["n_tup_del"],
                "rows_live_at_end": self.samples[-1][table]["n_live_tup"],
            }
        return {
            "database": self.name,
            "rate_offered": self.rate,
            "rate_achieved": round(self.achieved, 1),
            "seconds": self.seconds,
            "tables": tables,
            # The partitioned outbox's explicit idempotency keys: the soak's rows all have one.
            "keys_table": {
                "bytes_max": max(s[parts.KEYS_TABLE]["bytes"] for s in self.samples),
                "n_dead_tup_max": max(s[parts.KEYS_TABLE]["n_dead_tup"] for s in self.samples),
            }
            if self.partitioned
            else None,
            "drops": [{"t": round(t, 1), "partition": n} for t, n in self.drops],
            "receipts_purged": [{"t": round(t, 1), "rows": n} for t, n in self.purged],
            "kept_at_last_run": self.kept,
            "errors": self.errors[:20],
            "check": self.check,
            "staging_failures_retried": self.failed,
            "drops_refused_at_drop_time": self.refused[:20],
            "deadlocks_logged": {
                name: path.read_text(errors="replace").count("deadlock detected")
                for name, path in self.logs.items()
            },
            "samples": self.samples,
        }

    def _first_removal(self, table: str) -> float | None:
        """When soak rows first left ``table``: the first sample with fewer live rows than the
        one before (a partition holding rows dropped) or with deleted rows (the batched
        DELETEs). Drops of partitions still empty (created before the soak) do not count."""
        for before, s in zip(self.samples, self.samples[1:], strict=False):
            if s[table]["n_tup_del"] > 0 or s[table]["n_live_tup"] < before[table]["n_live_tup"]:
                return float(s["t"])
        return None


def soak(bench: Bench, dbs: dict[str, Bench], *, rate: float, seconds: float) -> dict[str, Any]:
    """Both databases' soaks at once; their reports."""
    soaks = {name: _Soak(bench, db, name, rate=rate, seconds=seconds) for name, db in dbs.items()}
    failures: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            soaks[name].run()
        except BaseException as exc:
            failures[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in soaks]
    progress(f"R-RETAIN soak: {rate:.0f} events/s per database for {seconds:.0f} s, both at once")
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        name, exc = next(iter(failures.items()))
        raise RuntimeError(f"the {name} soak failed: {exc}") from exc
    reports = {name: s.report() for name, s in soaks.items()}
    for name, rep in reports.items():
        progress(f"R-RETAIN soak {name}: {rep['check']}; drops {len(rep['drops'])}")
    return reports


# -- side by side ------------------------------------------------------------------------------


def _commit7(db: Bench, rows: list[dict[str, object]], topic: str) -> float:
    """Stage ``rows`` on ``topic`` in one transaction, each with a UUIDv7 id of now."""
    with db.engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            chunk = [
                {**row, "id": uuid7(), "event_key": uuid.uuid4().hex, "topic": topic}
                for row in rows[start : start + 5000]
            ]
            conn.execute(sa.insert(outbox), chunk)
    return time.time()


def _drain(db: Bench, topics: Topics, rows: list[dict[str, object]]) -> float:
    """:func:`bench.fixtures.drain_rate` with UUIDv7 ids (the partition of now)."""
    topic = topics.new()
    restage(db, [])
    with relay_processes(db, 1):
        sentinel(db, topics, topic)
        committed = _commit7(db, rows, topic)
        with cpu_window():
            if not topics.wait(topic, len(rows) + 1, timeout=600):
                raise TimeoutError(f"only {topics.count(topic) - 1} of {len(rows)} rows published")
    last = max(topics.append_times(topic).values())
    return len(rows) / (last / 1000 - committed)


def _r5(db: Bench, transactions: int, writers: int) -> float:
    return stage.one_statement_block(db.engine, transactions, writers=writers)


def side_by_side(
    bench: Bench, dbs: dict[str, Bench], *, repetitions: int, transactions: int
) -> list[Cell]:
    """Drain and R5 (one statement, 8 writers), partitioned and unpartitioned, interleaved."""
    topics = Topics(bench)
    rows = staged_rows(bench.rows, topic="(set per turn)", keys=bench.keys)
    sides: dict[str, Callable[[], float]] = {}
    for name, db in dbs.items():
        sides[f"drain, {name}"] = functools.partial(_drain, db, topics, rows)
    for name, db in dbs.items():
        sides[f"R5 one statement + stage(), {name}"] = functools.partial(_r5, db, transactions, 1)
    for name, db in dbs.items():
        sides[f"R5 {stage.WRITERS} writers + stage(), {name}"] = functools.partial(
            _r5, db, transactions, stage.WRITERS
        )
    try:
        run = interleave(sides, repetitions=repetitions)
    finally:
        topics.close()
    cells = []
    for label, what, unit, note in (
        (
            "drain",
            "relay drain rate",
            "rows/s",
            f"{bench.rows} rows (UUIDv7 ids) committed in one transaction; rate from the commit "
            "to the last record's LogAppendTime",
        ),
        ("R5 one statement + stage()", "R5 one statement + stage()", "tx/s", ""),
        (
            f"R5 {stage.WRITERS} writers + stage()",
            f"R5 {stage.WRITERS} writers + stage()",
            "tx/s",
            "",
        ),
    ):
        cell = Cell(
            f"R-RETAIN {label.split(' + ')[0]}",
            f"{label}, {PARTITIONED}",
            [f"{label}, {FLAT}"],
            unit,
            target=">= 0.95",
            measures=f"{what}, tables partitioned by minute / unpartitioned",
            notes=[note or f"{transactions} transactions per block"],
        )
        cell.take(run)
        cells.append(cell)
    return cells


def retain_cells(
    bench: Bench, *, repetitions: int, seconds: float, rate: float, transactions: int
) -> tuple[list[Cell], dict[str, Any]]:
    """The soak on both databases, then the side-by-side cells; the soak's report."""
    dbs = {
        PARTITIONED: _database(bench, "oncely_rretain_part", partitioned=True),
        FLAT: _database(bench, "oncely_rretain_flat", partitioned=False),
    }
    try:
        reports = soak(bench, dbs, rate=rate, seconds=seconds)
        cells = side_by_side(bench, dbs, repetitions=repetitions, transactions=transactions)
    finally:
        for db in dbs.values():
            _drop_database(bench, db)
    return cells, reports


def soak_result(reports: dict[str, Any]) -> dict[str, Any]:
    """The soak as a result line of the table (``kind`` soak)."""
    summary = {}
    for name, rep in reports.items():
        summary[name] = {
            "check": rep["check"],
            "staging_failures_retried": rep["staging_failures_retried"],
            "deadlocks_logged": rep["deadlocks_logged"],
            "drops_refused_at_drop_time": len(rep["drops_refused_at_drop_time"]),
            "tables": {
                t: {k: v for k, v in d.items() if k != "bytes_from_first_removal"}
                for t, d in rep["tables"].items()
            },
        }
    return {
        "cell": "R-RETAIN soak",
        "kind": "soak",
        "measures": "sizes, n_dead_tup and drops under a steady load with retention on",
        "summary": summary,
    }
