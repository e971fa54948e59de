"""R-DBZ, R-DBZ-HOT and R-DBZ p99: oncely's relay vs Debezium's Outbox Event Router, on the same
broker, database and rows.

Each side runs as its own process, as deployed: the relay as ``oncely relay run`` (the bench's
relay settings), Debezium as one connector in a Kafka Connect standalone worker
(:class:`~oncely.devstack.connect.ConnectNode`) configured by
:func:`oncely.debezium.connector_config`, the configuration ``oncely debezium config`` prints.

- **R-DBZ** drain rate (rows/s, relay / Debezium with ``poll.interval.ms=10``, target >= 1.5):
  rows of 200 B over ``keys`` keys. Debezium as ``oncely debezium config`` configures it
  (``poll.interval.ms`` 500 by default) is reported beside it as context: its queue hands
  records to Kafka Connect once ``max.batch.size`` (2048) are waiting or ``poll.interval.ms``
  has passed, so a backlog leaves in 500 ms steps; a Debezium user who cares sets it lower.
- **R-DBZ-HOT** the same with every row on one key (target >= 1.5).
- **R-DBZ p99** commit → Kafka p99 (ms, relay / tuned Debezium, target <= 1.0): single-row
  transactions written open loop at 50% of the slower side's median R-DBZ drain rate, the same
  offered load for both (each side's share of its own drain rate is ``utilisation``), from
  ``WRITER_PROCESSES`` writer processes of ``WRITER_THREADS`` threads each
  (:func:`bench.fixtures.process_writers`). When this machine cannot offer that rate (on 2
  cores it cannot: about 20,000 single-row transactions/s), :func:`offered_rate` probes lower
  ones (``PROBE_STEP`` apart, ``PROBE_SECONDS`` per side) and the cell measures at the highest
  one both sides were offered with the writers on schedule and ``PROBE_IDLE`` of the CPU idle;
  its description then names both rates, and its notes every probe. A side with under
  ``CPU_BOUND_IDLE`` CPU idle in its measured turns makes the cell "not a result" (no
  verdict).

What is fair, and how each number is taken:

- Only one side runs at a time. Each turn starts its side, runs one row through it (the
  *sentinel*: the relay is reading, the connector has finished its snapshot of the empty outbox
  and is streaming), measures, then stops it: the relay processes get SIGTERM; the connector is
  deleted and its replication slot and publication dropped, so no walsender decodes WAL during
  the relay's turns. Each turn starts from an empty, vacuumed outbox and writes to a fresh
  6-partition topic. The Connect worker stays up for the whole cell (idle in the relay's turns),
  so its JVM is warm after the harness's warm-up turn.
- Steady state, not start-up: both sides are running when the rows are committed, in one
  transaction; the drain rate is ``rows / (last record's append time - commit time)``.
  Debezium's walsender may decode that transaction's WAL before its commit; its replay through
  ``pgoutput``, event building, routing and producing are all timed. Neither side writes to
  the rows (the relay records one progress row per page). Producers keep their defaults: the
  relay's (lz4, linger 5 ms, idempotent), Kafka Connect's (no compression, linger 5 ms).
- Times are on one clock: every topic has ``message.timestamp.type=LogAppendTime``, and
  writers take ``time.time()`` on the same host.
- Latency: event ``i`` is due at ``t0 + i / rate`` whatever happened before (open loop).
  commit → Kafka is the append time minus the writer's clock right after its commit returned;
  schedule → Kafka (from the due time) and ``writer_lag_ms`` are reported beside it, so a
  writer that fell behind (coordinated omission) shows. Events due in the first
  ``WARMUP_SECONDS`` are left out. Each writer thread has its own autocommit connection and
  one prepared INSERT; the writers' lag p99 of every turn is in the notes.

Kafka Connect and Debezium are resolved with Maven the first time (a few minutes, once).
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import tempfile
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.fixtures import (
    Bench,
    Side,
    Topics,
    commit_latency,
    drain_rate,
    relay_processes,
    staged_rows,
)
from bench.harness import Cell, interleave, progress
from oncely.debezium import CONNECTOR_CLASS, ConnectorOptions, connector_config, drop_slot
from oncely.devstack._process import tail
from oncely.devstack.connect import ConnectNode

RELAY = "oncely relay"
DEBEZIUM = "Debezium EventRouter (default poll.interval.ms)"
DEBEZIUM_TUNED = "Debezium EventRouter, poll.interval.ms=10"
RELAY_HOT = "oncely relay, one key"
DEBEZIUM_HOT = "Debezium EventRouter, poll.interval.ms=10, one key"
TUNED = {"poll.interval.ms": "10"}
LOAD = 0.5
WARMUP_SECONDS = 1.0
#: R-DBZ p99's writers: processes (not held back by the bench's GIL), threads in each.
WRITER_PROCESSES = 4
WRITER_THREADS = 2
#: How a rate is probed before R-DBZ p99 measures at it (see offered_rate).
PROBE_SECONDS = 4.0
PROBE_IDLE = 0.20
PROBE_LAG_MS = 100.0
PROBE_STEP = 0.7
MIN_RATE = 200.0


def _latency(bench: Bench, topics: Topics, side: Side, rate: float, seconds: float) -> Any:
    return commit_latency(
        bench,
        topics,
        side,
        rate,
        seconds,
        writers=WRITER_THREADS,
        writer_processes=WRITER_PROCESSES,
        warmup_seconds=WARMUP_SECONDS,
    )


def offered_rate(
    bench: Bench, topics: Topics, sides: Mapping[str, Side], planned: float
) -> tuple[float, list[dict[str, Any]]]:
    """The highest rate, from ``planned`` down in steps of ``PROBE_STEP`` (or straight to
    ``PROBE_STEP`` times what the writers achieved, when that is lower; not under
    ``MIN_RATE``), that every side was offered in a ``PROBE_SECONDS`` turn: the writers kept
    up (achieved >= 95% of it, lag p99 <= ``PROBE_LAG_MS``) and the machine kept
    ``PROBE_IDLE`` of its CPU idle. Returns it and every probe."""
    rate, probes = planned, []
    while True:
        ok, next_rate = True, rate * PROBE_STEP
        for name, side in sides.items():
            result = _latency(bench, topics, side, rate, PROBE_SECONDS)
            achieved = result["achieved_rate_per_second"]
            lag = result["writer_lag_ms"]["p99"]
            idle = result["cpu"]["load_idle_share"]
            why = [
                *([f"achieved {achieved:.0f}/s"] if achieved < 0.95 * rate else []),
                *([f"writers' lag p99 {lag:.0f} ms"] if not lag <= PROBE_LAG_MS else []),
                *([f"CPU idle {idle:.0%}"] if idle < PROBE_IDLE else []),
            ]
            probes.append({"rate": round(rate), "side": name, "ok": not why, "why": ", ".join(why)})
            progress(f"probe {name} at {rate:.0f}/s: {', '.join(why) or 'ok'}")
            if why:
                ok, next_rate = False, min(next_rate, achieved * PROBE_STEP)
                break
        if ok or rate <= MIN_RATE:
            return rate, probes
        rate = max(MIN_RATE, next_rate)


@contextlib.contextmanager
def relay_side(bench: Bench) -> Iterator[None]:
    """One ``oncely relay run`` process for the block (the bench's relay settings)."""
    with relay_processes(bench, 1):
        yield


@contextlib.contextmanager
def debezium_connector(
    bench: Bench, connect: ConnectNode, extra: Mapping[str, str]
) -> Iterator[None]:
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
    except TimeoutError as exc:
        status = connect.connector_status(options.name)
        raise TimeoutError(
            f"{exc}; connector {options.name}: {status}; last lines of {connect.log_file}:\n"
            f"{tail(connect.log_file, 30)}"
        ) from exc
    finally:
        connect.remove_connector(options.name)
        drop_slot(bench.engine, options.slot_name)
        with bench.engine.begin() as conn:
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {options.publication_name}"))


def connect_versions(connect: ConnectNode) -> dict[str, str]:
    """What the running worker reports: Kafka Connect's version and Debezium's connector's."""
    answers = []
    for path in ("", "connector-plugins"):
        url = f"http://127.0.0.1:{connect.rest_port}/{path}"
        with urllib.request.urlopen(url, timeout=10) as response:
            answers.append(json.load(response))
    root, plugins = answers
    debezium = next(p["version"] for p in plugins if p["class"] == CONNECTOR_CLASS)
    return {"kafka_connect": root["version"], "debezium": debezium, "connect_heap": connect.heap}


def connect_worker(
    bench: Bench, stack: contextlib.ExitStack, *, prefix: str
) -> tuple[ConnectNode, Topics, dict[str, str]]:
    """A Kafka Connect worker and the topics of a cell, stopped and deleted when ``stack``
    closes; and the versions the worker runs."""
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    connect = ConnectNode(data_dir=directory, bootstrap_servers=bench.bootstrap)
    connect.start()
    stack.callback(connect.stop)
    topics = Topics(bench)
    stack.callback(topics.close)
    return connect, topics, connect_versions(connect)


def debezium_cells(
    bench: Bench, *, repetitions: int, rows: int, seconds: float
) -> tuple[list[Cell], dict[str, Any], dict[str, str]]:
    """R-DBZ, R-DBZ-HOT (drain, interleaved) and R-DBZ p99 (latency, interleaved).

    Returns the cells, the latency details (percentiles of every repetition) and the versions.
    """
    with contextlib.ExitStack() as stack:
        connect, topics, versions = connect_worker(bench, stack, prefix="r-dbz-")

        relay: Side = functools.partial(relay_side, bench)
        tuned: Side = functools.partial(debezium_connector, bench, connect, TUNED)
        default: Side = functools.partial(debezium_connector, bench, connect, {})
        spread = staged_rows(rows, topic="(set per turn)", keys=bench.keys)
        hot = staged_rows(rows, topic="(set per turn)", keys=1)
        drains: dict[str, Callable[[], float]] = {
            RELAY: functools.partial(drain_rate, bench, topics, relay, spread),
            DEBEZIUM_TUNED: functools.partial(drain_rate, bench, topics, tuned, spread),
            DEBEZIUM: functools.partial(drain_rate, bench, topics, default, spread),
            RELAY_HOT: functools.partial(drain_rate, bench, topics, relay, hot),
            DEBEZIUM_HOT: functools.partial(drain_rate, bench, topics, tuned, hot),
        }
        run = interleave(drains, repetitions=repetitions)
        note = (
            f"{rows} rows of 200 B committed in one transaction while the side runs; relay page "
            f"{bench.batch_size}; rate from the commit to the last record's LogAppendTime"
        )
        drain = Cell(
            "R-DBZ",
            RELAY,
            [DEBEZIUM_TUNED, DEBEZIUM],
            "rows/s",
            target=">= 1.5",
            measures=f"drain rate, oncely / Debezium EventRouter (poll.interval.ms=10), "
            f"{bench.keys} keys",
            notes=[note],
        )
        drain.take(run)
        drain_hot = Cell(
            "R-DBZ-HOT",
            RELAY_HOT,
            [DEBEZIUM_HOT],
            "rows/s",
            target=">= 1.5",
            measures="drain rate, oncely / Debezium EventRouter (poll.interval.ms=10), every "
            "row on one key",
            notes=[note],
        )
        drain_hot.take(run)

        medians = {name: statistics.median(run.rates[name]) for name in (RELAY, DEBEZIUM_TUNED)}
        planned = LOAD * min(medians.values())
        latency_sides = {RELAY: relay, DEBEZIUM_TUNED: tuned}
        rate, probes = offered_rate(bench, topics, latency_sides, planned)
        runs: dict[str, list[dict[str, Any]]] = {RELAY: [], DEBEZIUM_TUNED: []}

        def latency(name: str, side: Side) -> float:
            result = _latency(bench, topics, side, rate, seconds)
            result["utilisation"] = round(rate / medians[name], 2)
            runs[name].append(result)
            return float(result["commit_to_kafka_ms"]["p99"])

        latency_run = interleave(
            {
                RELAY: functools.partial(latency, RELAY, relay),
                DEBEZIUM_TUNED: functools.partial(latency, DEBEZIUM_TUNED, tuned),
            },
            repetitions=repetitions,
            warmup=False,
        )
        p99 = Cell(
            "R-DBZ p99",
            RELAY,
            [DEBEZIUM_TUNED],
            "ms",
            target="<= 1.0",
            measures=(
                f"commit-to-Kafka p99 at {LOAD:.0%} of the slower side's drain rate ({rate:.0f}/s)"
                if rate >= planned
                else f"commit-to-Kafka p99 at {rate:.0f}/s, the highest rate this machine could "
                f"offer both sides ({LOAD:.0%} of the slower drain rate, {planned:.0f}/s, "
                "could not be)"
            )
            + ", oncely / Debezium EventRouter (poll.interval.ms=10)",
            notes=[
                f"open loop, one row per transaction from {WRITER_PROCESSES} writer processes "
                f"x {WRITER_THREADS} threads (one connection each), {seconds:.0f} s per turn, "
                f"events due in the first {WARMUP_SECONDS:.0f} s excluded; append time "
                "(LogAppendTime) minus the writer's clock after its commit",
                "rates probed for "
                + f"{PROBE_SECONDS:.0f} s per side before the cell: "
                + ", ".join(
                    f"{p['rate']:.0f}/s {p['side']}: {'ok' if p['ok'] else p['why']}"
                    for p in probes
                ),
            ],
            verdict_needs_idle=True,
        )
        p99.take(latency_run)
        p99.notes.append(
            "writers' lag p99 (ms) per turn: "
            + "; ".join(
                f"{name}: {', '.join(str(r['writer_lag_ms']['p99']) for r in results)}"
                for name, results in runs.items()
            )
        )
        behind = [
            name
            for name, results in runs.items()
            if any(r["achieved_rate_per_second"] < 0.9 * rate for r in results)
        ]
        if behind:
            p99.notes.append(
                f"the writers fell behind the schedule for {', '.join(behind)}: the offered load "
                "was lower than planned (achieved_rate_per_second, writer_lag_ms)"
            )
    details = {
        "rate_per_second": round(rate, 1),
        "planned_rate_per_second": round(planned, 1),
        "load": LOAD,
        "probes": probes,
        "runs": runs,
    }
    return [drain, drain_hot, p99], details, versions
