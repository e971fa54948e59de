"""R-DBZ: oncely's relay vs Debezium's Outbox Event Router, on the same broker, database and rows.

Two comparisons, each side running as its own process, as deployed: the relay as
``oncely relay run`` (bench relay settings), Debezium as one connector in a Kafka Connect
standalone worker (:class:`~oncely.devstack.connect.ConnectNode`) configured by
:func:`oncely.debezium.connector_config`, the configuration ``oncely debezium config`` prints.

- **Drain rate** (rows/s, relay / Debezium, target >= 1.5): the R1 rows (200 B payloads over
  ``keys`` keys), a fifth as many, so the cell stays short.
- **commit → Kafka latency** (ms, relay p99 / Debezium p99, target <= 1/3): single-row
  transactions written open loop at 50% of the relay's measured drain rate.

Debezium runs twice in each: as ``oncely debezium config`` configures it, and with
``poll.interval.ms=10``. Its queue hands records to Kafka Connect once ``max.batch.size``
(2048) are waiting or ``poll.interval.ms`` (500 ms by default) has passed, so with the default
a backlog leaves in 500 ms steps and a record below 4096/s waits up to half a second: that is
configuration, not capacity, and a Debezium user who cares sets it lower. The targets apply to
the tuned connector (the stronger side); the default one is reported beside it.

What is fair, and how each number is taken:

- Only one side runs at a time. Each turn starts its side, runs one row through it (the
  *sentinel*: the relay is claiming, the connector has finished its snapshot of the empty outbox
  and is streaming), measures, then stops it: the relay process gets SIGTERM; the connector is
  deleted and its replication slot and publication dropped, so no walsender decodes WAL during
  the relay's turns. Each turn starts from an empty, vacuumed outbox and writes to a fresh
  6-partition topic. The Connect worker itself stays up for the whole cell (idle in the relay's
  turns), so its JVM is warm after the harness's warm-up turn.
- Steady state, not start-up: both sides are already running when the rows are committed. The
  drain rate is ``rows / (last record's append time - commit time)``; the rows are committed in
  one transaction (then ANALYZEd, as R-CLUSTER does, for the relay's planner), so neither side
  sees a row before the clock starts. Debezium's walsender may read and decode that transaction's
  WAL before its commit; its replay through ``pgoutput``, Debezium's event building, routing
  and producing are all timed. The relay settles every row (UPDATEs), Debezium does not (rows
  stay ``pending``): that is each design's cost. Producers keep their defaults: the relay's
  (lz4, linger 5 ms, 2000 records in flight), Kafka Connect's (no compression, linger 5 ms, one
  request in flight).
- Times are on one clock: every topic has ``message.timestamp.type=LogAppendTime``, so a
  record's timestamp is the broker's append time (the relay's and Debezium's own record
  timestamps are overwritten), and writers take ``time.time()`` on the same host.
- Latency: the same offered load for every side (50% of the relay's median drain rate; each
  side's share of its own drain rate is recorded as ``utilisation``); event ``i`` is due at
  ``t0 + i / rate`` whatever happened before (open loop). commit → Kafka is the append time
  minus the writer's clock right after its commit returned; schedule → Kafka (from the due
  time) is reported beside it, so a writer that fell behind (coordinated omission) shows there
  and in ``writer_lag_ms``, and a note says so. Events due in the first ``WARMUP_SECONDS`` are
  left out. ``WRITERS`` threads, each with its own autocommit connection and one prepared
  INSERT: on 2 cores more threads write less (they contend for the GIL: one thread committed
  about 3,400 single-row transactions/s here, eight about 1,600).

Kafka Connect and Debezium are resolved with Maven the first time (a few minutes, once, like the
broker). After that the cell takes about two minutes with the defaults (Connect start-up, 4
drain turns of each of the 3 sides, 3 latency runs), so it is in the default ``python -m bench``
set.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_LOG_APPEND_TIME, Consumer, TopicPartition
from confluent_kafka.admin import NewTopic

from bench.cluster_cells import processes, wait_ready
from bench.consumer_cells import percentiles
from bench.fixtures import Bench, outbox_writers, restage, staged_rows
from bench.harness import Cell, alternate, open_loop
from oncely.debezium import CONNECTOR_CLASS, ConnectorOptions, connector_config, drop_slot
from oncely.devstack.connect import ConnectNode
from oncely.storage import outbox

RELAY = "oncely relay"
DEBEZIUM = "Debezium EventRouter"
DEBEZIUM_TUNED = "Debezium EventRouter, poll.interval.ms=10"
TUNED = {"poll.interval.ms": "10"}
LOAD = 0.5
WARMUP_SECONDS = 1.0
WRITERS = 2

Side = Callable[[], contextlib.AbstractContextManager[None]]


class _Topics:
    """Fresh ``LogAppendTime`` topics for the cell's turns, and how many records they hold."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.admin = bench.admin()
        self.created: list[str] = []
        self.consumer = Consumer(
            {
                "bootstrap.servers": bench.bootstrap,
                "group.id": f"r-dbz-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
            }
        )

    def new(self) -> str:
        name = f"r-dbz-{uuid.uuid4().hex[:12]}"
        topic = NewTopic(
            name,
            num_partitions=self.bench.partitions,
            config={"message.timestamp.type": "LogAppendTime"},
        )
        self.admin.create_topics([topic])[name].result(30)
        self.created.append(name)
        return name

    def count(self, topic: str) -> int:
        return sum(
            self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(self.bench.partitions)
        )

    def wait(self, topic: str, total: int, *, timeout: float) -> bool:
        """Wait until ``topic`` holds ``total`` records; whether it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.count(topic) < total:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def append_times(self, topic: str) -> dict[str, float]:
        """Every record's broker append time (epoch ms) by its ``id`` header."""
        total = self.count(topic)
        self.consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(self.bench.partitions)]
        )
        times: dict[str, float] = {}
        seen, deadline = 0, time.monotonic() + 120
        while seen < total and time.monotonic() < deadline:
            for message in self.consumer.consume(1000, 0.5):
                if message.error() is not None:
                    continue
                seen += 1
                kind, stamp = message.timestamp()
                assert kind == TIMESTAMP_LOG_APPEND_TIME, f"{topic} is not LogAppendTime"
                event_id = dict(message.headers() or []).get("id")
                if isinstance(event_id, bytes):
                    times[event_id.decode()] = float(stamp)
        self.consumer.unassign()
        return times

    def close(self) -> None:
        self.consumer.close()
        if self.created:
            for future in self.admin.delete_topics(self.created).values():
                with contextlib.suppress(Exception):
                    future.result(30)


@contextlib.contextmanager
def _relay(bench: Bench) -> Iterator[None]:
    """One ``oncely relay run`` process for the block, ready (its ``/readyz``) at the start."""
    with processes(["relay", "run"], 1, bench.relay_env()) as running:
        wait_ready(running)
        yield


@contextlib.contextmanager
def _debezium(bench: Bench, connect: ConnectNode, extra: Mapping[str, str]) -> Iterator[None]:
    """A fresh connector (own name, slot, publication) for the block; all dropped afterwards."""
    tag = uuid.uuid4().hex[:10]
    options = ConnectorOptions.from_database_url(
        bench.database_url,
        name=f"r-dbz-{tag}",
        logical_name=f"r_dbz_{tag}",
        slot_name=f"r_dbz_{tag}",
        publication_name=f"r_dbz_{tag}",
    )
    connect.add_connector(options.name, {**connector_config(options), **extra})
    try:
        yield
    finally:
        connect.remove_connector(options.name)
        drop_slot(bench.engine, options.slot_name)
        with bench.engine.begin() as conn:
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {options.publication_name}"))


def _sentinel(bench: Bench, topics: _Topics, topic: str) -> None:
    """One row through the running side, so it is claiming (or streaming) before any timing."""
    [row] = staged_rows(1, topic=topic, keys=1)
    with bench.engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "aggregateid": "sentinel"})
    if not topics.wait(topic, 1, timeout=120):
        raise TimeoutError(f"the sentinel row never reached {topic}")


def _commit_at_once(bench: Bench, rows: list[dict[str, object]], topic: str) -> float:
    """Stage ``rows`` (fresh ids, ``topic``) in one transaction; return when it committed."""
    with bench.engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            chunk = [
                {**row, "id": uuid.uuid4(), "event_key": uuid.uuid4().hex, "topic": topic}
                for row in rows[start : start + 5000]
            ]
            conn.execute(sa.insert(outbox), chunk)
    committed = time.time()
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE oncely_outbox"))
    return committed


def _drain_rate(bench: Bench, topics: _Topics, side: Side, rows: list[dict[str, object]]) -> float:
    """Rows/s from the commit of ``rows`` to the append of the last of them, ``side`` running."""
    topic = topics.new()
    restage(bench, [])
    with side():
        _sentinel(bench, topics, topic)
        committed = _commit_at_once(bench, rows, topic)
        if not topics.wait(topic, len(rows) + 1, timeout=600):
            raise TimeoutError(f"only {topics.count(topic) - 1} of {len(rows)} rows published")
    last = max(topics.append_times(topic).values())
    return len(rows) / (last / 1000 - committed)


def _latency(
    bench: Bench, topics: _Topics, side: Side, rate: float, seconds: float
) -> dict[str, Any]:
    """commit → Kafka (and schedule → Kafka) percentiles of open-loop single-row transactions.

    Each writer has its own autocommit connection and one prepared INSERT (one round trip per
    transaction), so the writers are not what limits the offered load.
    """
    topic = topics.new()
    rows = staged_rows(int(rate * seconds), topic=topic, keys=bench.keys)
    restage(bench, [])
    with outbox_writers(bench, rows, count=WRITERS) as writes, side():
        _sentinel(bench, topics, topic)
        open_loop(rate, seconds, writes.writers)
        topics.wait(topic, len(rows) + 1, timeout=120)
    due, committed = writes.due, writes.committed
    appended = topics.append_times(topic)
    measured_from = due[0] + WARMUP_SECONDS
    commit_ms, schedule_ms, lag_ms, missing = [], [], [], 0
    for row, due_at, committed_at in zip(rows, due, committed, strict=True):
        if due_at < measured_from:
            continue
        stamp = appended.get(str(row["id"]))
        if stamp is None:
            missing += 1
            continue
        commit_ms.append(stamp - committed_at * 1000)
        schedule_ms.append(stamp - due_at * 1000)
        lag_ms.append((committed_at - due_at) * 1000)
    return {
        "commit_to_kafka_ms": percentiles(commit_ms),
        "schedule_to_kafka_ms": percentiles(schedule_ms),
        "writer_lag_ms": percentiles(lag_ms),
        "achieved_rate_per_second": round(writes.achieved_rate(), 1),
        "events_measured": len(commit_ms),
        "missing": missing,
    }


def _versions(connect: ConnectNode) -> dict[str, str]:
    """What the running worker reports: Kafka Connect's version and Debezium's connector's."""
    answers = []
    for path in ("", "connector-plugins"):
        url = f"http://127.0.0.1:{connect.rest_port}/{path}"
        with urllib.request.urlopen(url, timeout=10) as response:
            answers.append(json.load(response))
    root, plugins = answers
    debezium = next(p["version"] for p in plugins if p["class"] == CONNECTOR_CLASS)
    return {"kafka_connect": root["version"], "debezium": debezium, "connect_heap": connect.heap}


def debezium_cell(bench: Bench, *, repetitions: int, rows: int, seconds: float) -> dict[str, Any]:
    """R-DBZ: drain rate (``rows`` rows, alternated) and latency at 50% of the relay's rate."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="r-dbz-")))
        connect = ConnectNode(data_dir=directory, bootstrap_servers=bench.bootstrap)
        connect.start()
        stack.callback(connect.stop)
        topics = _Topics(bench)
        stack.callback(topics.close)
        versions = _versions(connect)

        sides: dict[str, Side] = {
            RELAY: lambda: _relay(bench),
            DEBEZIUM: lambda: _debezium(bench, connect, {}),
            DEBEZIUM_TUNED: lambda: _debezium(bench, connect, TUNED),
        }
        staged = staged_rows(rows, topic="(set per turn)", keys=bench.keys)
        cell = Cell(
            "R-DBZ",
            RELAY,
            [DEBEZIUM_TUNED, DEBEZIUM],
            "rows/s",
            target=f">= 1.5 (vs {DEBEZIUM_TUNED})",
            notes=[
                f"{rows} rows of 200 B over {bench.keys} keys committed in one transaction "
                f"while the side runs; relay batch {bench.batch_size}; rate from the commit to "
                "the last record's LogAppendTime",
            ],
        )
        cell.rates = alternate(
            {
                name: functools.partial(_drain_rate, bench, topics, side, staged)
                for name, side in sides.items()
            },
            repetitions=repetitions,
        )
        drain = {name: statistics.median(rates) for name, rates in cell.rates.items()}
        rate = LOAD * drain[RELAY]
        latency: dict[str, dict[str, Any]] = {}
        for name, side in sides.items():
            latency[name] = _latency(bench, topics, side, rate, seconds)
            latency[name]["utilisation"] = round(rate / drain[name], 2)
    relay_p99 = latency[RELAY]["commit_to_kafka_ms"]["p99"]
    notes = [
        f"open loop, one row per transaction from {WRITERS} writer threads, {seconds:.0f} s "
        f"per side, events due in the first {WARMUP_SECONDS:.0f} s excluded; append time "
        "(LogAppendTime) minus the writer's clock after its commit"
    ]
    behind = [n for n, r in latency.items() if r["achieved_rate_per_second"] < 0.9 * rate]
    if behind:
        notes.append(
            f"the writers fell behind the schedule for {', '.join(behind)}: the offered load "
            "was lower than planned (achieved_rate_per_second, writer_lag_ms)"
        )
    result = cell.to_json()
    result["latency"] = {
        "load": LOAD,
        "rate_per_second": round(rate),
        "seconds": seconds,
        "sides": latency,
        "p99_ratios": {
            name: round(relay_p99 / latency[name]["commit_to_kafka_ms"]["p99"], 3)
            for name in cell.denominators
        },
        "target": f"<= 0.333 (vs {DEBEZIUM_TUNED})",
        "notes": notes,
    }
    result["environment"] = versions
    result["seconds"] = round(time.monotonic() - started)
    return result
