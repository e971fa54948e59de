"""R4 and R4-quiet: commit → effect latency through the whole pipeline, as deployed.

One pipeline serves the whole run: an ``oncely relay run`` process and an ``oncely consume
bench.effects_app:effects --effect apply`` process (the consumer's default settings), started
once, ready, with one sentinel event through them. Then:

1. **Drain rate**: ``drain_events`` outbox rows committed in one transaction; the rate is
   rows / (the last effect row's ``written_at`` - the commit's time), median of 3.
2. **Offered rates**: 50% (R4) and 10% (R4-quiet) of that drain rate are planned. One-row
   transactions at those rates are more than 2 cores can commit while the pipeline runs (the
   drain rate comes from one 20,000-row transaction), and a latency at 3% CPU idle says little:
   :meth:`Pipeline.offered_rate` probes each side down from its plan (``PROBE_SECONDS`` turns)
   to the highest rate at which the writers kept their schedule and the machine kept
   ``IDLE_NEEDED`` of its CPU idle (R4 20%, R4-quiet 30%, as its target says); the cell names
   both rates and every probe.
3. **Latency turns**, interleaved, 3 repetitions, at the offered rates: open-loop single-row
   outbox transactions from ``WRITER_PROCESSES`` writer processes of ``WRITERS`` threads
   (:mod:`bench.writers`), each recording (event index, commit time). commit →
   effect is the effect row's ``written_at`` (its ``clock_timestamp()`` default, at the insert
   just before the consumer's commit) minus the writer's clock right after its commit returned
   (one host, one clock); the receipt's ``applied_at`` (the consumer transaction's ``now()``,
   its start, so earlier) is reported beside it. Events due in the first ``WARMUP_SECONDS``
   are left out.
   schedule → effect and the writers' lag (commit - due) are reported beside it, as R-DBZ p99
   does, so a writer that fell behind shows. Every turn's CPU idle share (``/proc/stat``) is in
   the notes; a side whose median is under its ``IDLE_NEEDED`` gets no verdict.
4. **Raw Kafka** (context): a producer and a consumer in this process at R4's rate, the same
   keys, 200 B values: produce (record timestamp) → consume p99.

The values are absolute (ms, p99 of a turn, median of the 3 turns) against the targets
(R4 < 40 ms, R4-quiet < 15 ms), not ratios.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, Producer

from bench.fixtures import (
    Bench,
    Running,
    commit_at_once,
    delete_topic,
    metric,
    percentiles,
    processes,
    relay_processes,
    restage,
    wait_ready,
)
from bench.harness import Cell, cpu_window, interleave, open_loop, progress
from bench.writers import effects_topic, outbox_rows
from oncely.settings import ConsumerSettings

#: The writers: processes (spawned, each with its own GIL), threads (connections) in each.
WRITER_PROCESSES = 2
WRITERS = 2
WARMUP_SECONDS = 1.0
PROBE_SECONDS = 4.0
PROBE_LAG_MS = 100.0
PROBE_STEP = 0.7
MIN_RATE = 50.0
HALF, QUIET, RAW = (
    "pipeline at 50% of its drain rate",
    "pipeline at 10% of its drain rate",
    "raw Kafka produce→consume at the 50% rate",
)
LOADS = {HALF: 0.5, QUIET: 0.1}
#: The CPU idle share each side needs in its turns for its number to be a result (R4-quiet's
#: target names 30%; R4's is reported), and what its rate is probed for (see offered_rate).
IDLE_NEEDED = {HALF: 0.20, QUIET: 0.30}


def latencies(
    due: list[float],
    committed: list[float],
    applied: dict[int, float],
    *,
    warmup_seconds: float,
    written: dict[int, float] | None = None,
) -> dict[str, Any]:
    """commit → effect, schedule → effect and writer-lag percentiles (ms) of the events due
    after the first ``warmup_seconds``; ``applied`` maps an event index to its receipt's
    ``applied_at``, ``written`` (optional) to its effect row's ``written_at`` (epoch seconds).
    Events never applied are counted as ``missing``."""
    measured_from = due[0] + warmup_seconds
    commit_ms, schedule_ms, lag_ms, written_ms, missing = [], [], [], [], 0
    for i, (due_at, committed_at) in enumerate(zip(due, committed, strict=True)):
        if due_at < measured_from:
            continue
        lag_ms.append((committed_at - due_at) * 1000)
        done = applied.get(i)
        if done is None:
            missing += 1
            continue
        commit_ms.append((done - committed_at) * 1000)
        schedule_ms.append((done - due_at) * 1000)
        if written is not None and i in written:
            written_ms.append((written[i] - committed_at) * 1000)
    return {
        "commit_to_effect_ms": percentiles(commit_ms),
        "commit_to_row_written_ms": percentiles(written_ms),
        "schedule_to_effect_ms": percentiles(schedule_ms),
        "writer_lag_ms": percentiles(lag_ms),
        "achieved_rate_per_second": round(len(due) / max(1e-3, max(committed) - due[0]), 1),
        "events_measured": len(commit_ms),
        "missing": missing,
    }


class Pipeline:
    """The relay and consumer processes of the run, and what is measured through them."""

    def __init__(self, bench: Bench, consumer: Running, prefix: str) -> None:
        self.bench = bench
        self.consumer = consumer
        self.prefix = prefix

    def applied(self) -> float:
        return metric(self.consumer, "oncely_consumer_applied_total", effect="apply")

    def wait_applied(self, total: float, *, timeout: float, strict: bool = True) -> None:
        """Wait until the consumer has applied ``total`` events in all; past ``timeout``, raise
        ``TimeoutError`` when ``strict``, else return (the events left are counted missing).
        Raises ``RuntimeError`` when the consumer process has exited."""
        deadline = time.monotonic() + timeout
        while (done := self.applied()) < total:
            if self.consumer.proc.poll() is not None:
                raise RuntimeError(
                    f"the consumer exited with {self.consumer.proc.returncode} "
                    f"(see its log {self.consumer.log})"
                )
            if time.monotonic() > deadline:
                if not strict:
                    return
                raise TimeoutError(f"the pipeline applied {done:.0f} of {total:.0f} events")
            time.sleep(0.05)

    def drain(self, count: int) -> float:
        """Events/s from the commit of ``count`` rows (one transaction) to the last applied."""
        rows = outbox_rows(self.prefix, count, keys=self.bench.keys)
        before = self.applied()
        committed = commit_at_once(self.bench, rows, str(rows[0]["topic"]))
        with cpu_window():
            self.wait_applied(before + count, timeout=600)
        with self.bench.engine.connect() as conn:
            # The last effect row's insert time: the last batch's rows are written just
            # before its commit (its receipts' applied_at is its transaction's start).
            last = conn.execute(
                sa.text("SELECT EXTRACT(EPOCH FROM max(written_at)) FROM bench_effects")
            ).scalar_one()
        return count / max(1e-3, float(last) - committed)

    def latency(self, rate: float, seconds: float) -> dict[str, Any]:
        """One open-loop turn at ``rate`` for ``seconds`` from the writers' process."""
        with tempfile.TemporaryDirectory(prefix="r4-") as directory:
            out = Path(directory, "writes.json")
            spec = {
                "database_url": self.bench.database_url,
                "topic_prefix": self.prefix,
                "rate": rate,
                "seconds": seconds,
                "writers": WRITERS,
                "processes": WRITER_PROCESSES,
                "keys": self.bench.keys,
                "out": str(out),
            }
            before = self.applied()
            writers = subprocess.Popen(
                [sys.executable, "-m", "bench.writers", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert writers.stdin is not None and writers.stdout is not None
            try:
                if writers.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the writers' process exited with {writers.wait()}")
                total = int(rate * seconds)
                with cpu_window() as cpu:  # the writers' processes live through it
                    writers.stdin.write("go\n")
                    writers.stdin.flush()
                    if writers.stdout.readline().strip() != "done":
                        raise RuntimeError(f"the writers' process exited with {writers.wait()}")
                    self.wait_applied(before + total, timeout=120, strict=False)
                writers.stdin.write("exit\n")
                writers.stdin.flush()
                if writers.wait(60) != 0:
                    raise RuntimeError(f"the writers' process exited with {writers.returncode}")
            finally:
                if writers.poll() is None:
                    writers.kill()
                    writers.wait()
            writes = json.loads(out.read_text())
        index = {event_id: i for i, event_id in enumerate(writes["ids"])}
        applied: dict[int, float] = {}
        written: dict[int, float] = {}
        with self.bench.engine.connect() as conn:
            for event_id, done, row_written in conn.execute(
                sa.text(
                    "SELECT r.event_id::text, EXTRACT(EPOCH FROM r.applied_at),"
                    " EXTRACT(EPOCH FROM e.written_at)"
                    " FROM oncely_receipts r LEFT JOIN bench_effects e USING (event_id)"
                    " WHERE r.effect = 'apply' AND r.event_id = ANY(CAST(:ids AS uuid[]))"
                ),
                {"ids": writes["ids"]},
            ):
                applied[index[event_id]] = float(done)
                if row_written is not None:
                    written[index[event_id]] = float(row_written)
        result = latencies(
            writes["due"],
            writes["committed"],
            applied,
            warmup_seconds=WARMUP_SECONDS,
            written=written,
        )
        result["rate_per_second"] = round(rate, 1)
        result["cpu_idle"] = round(cpu.idle, 3)
        result["cpu_cores"] = {kind: round(v, 2) for kind, v in sorted(cpu.cores.items())}
        return result

    def offered_rate(
        self, planned: float, idle_needed: float
    ) -> tuple[float, list[dict[str, Any]]]:
        """The highest rate, from ``planned`` down in steps of ``PROBE_STEP`` (or straight to
        ``PROBE_STEP`` times what the writers achieved, when lower; not under ``MIN_RATE``),
        at which a ``PROBE_SECONDS`` turn kept the writers on schedule (achieved >= 95%,
        writers' lag p99 <= ``PROBE_LAG_MS``) and ``idle_needed`` of the CPU idle. Returns it
        and every probe."""
        rate, probes = planned, []
        while True:
            result = self.latency(rate, PROBE_SECONDS)
            achieved = result["achieved_rate_per_second"]
            lag, idle = result["writer_lag_ms"]["p99"], result["cpu_idle"]
            why = [
                *([f"achieved {achieved:.0f}/s"] if achieved < 0.95 * rate else []),
                *([f"writers' lag p99 {lag:.0f} ms"] if not lag <= PROBE_LAG_MS else []),
                *([f"CPU idle {idle:.0%}"] if idle < idle_needed else []),
            ]
            probes.append({"rate": round(rate), "ok": not why, "why": ", ".join(why)})
            progress(f"probe at {rate:.0f}/s: {', '.join(why) or 'ok'} (CPU idle {idle:.0%})")
            if not why or rate <= MIN_RATE:
                return rate, probes  # the last probe says whether it was carried
            rate = max(MIN_RATE, min(rate * PROBE_STEP, achieved * PROBE_STEP))


def raw_latency(bench: Bench, rate: float, seconds: float) -> dict[str, Any]:
    """Raw Kafka at ``rate`` for ``seconds``: produce (record timestamp) → consume and
    schedule → consume percentiles (ms), a producer and a consumer in this process."""
    topic = bench.new_topic()
    producer = Producer(
        {
            "bootstrap.servers": bench.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }
    )
    consumer = Consumer(
        {
            "bootstrap.servers": bench.bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
        }
    )
    joined = threading.Event()
    consumer.subscribe([topic], on_assign=lambda c, p: joined.set())
    total = int(rate * seconds)
    due = [0.0] * total
    produced: dict[int, float] = {}
    received: dict[int, float] = {}
    done = threading.Event()
    padding = b"x" * (200 - 8)

    def consume() -> None:
        # As the oncely consumer fetches: wait for the first record, then take what came with
        # it (consume(500, 0.05) would hold a record until 500 came or 50 ms passed).
        while len(received) < total and not done.is_set():
            first = consumer.poll(0.05)
            batch = [] if first is None else [first, *consumer.consume(499, 0)]
            for message in batch:
                if message.error() is None:
                    now = time.time()
                    (i,) = struct.unpack_from("q", message.value() or b"")
                    received[i] = now
                    produced[i] = message.timestamp()[1] / 1000

    while not joined.is_set():
        consumer.poll(0.1)
    reader = threading.Thread(target=consume)
    reader.start()
    lock = threading.Lock()

    def send(i: int, due_at: float) -> None:
        due[i] = due_at
        with lock:
            key = f"acc-{i % bench.keys}".encode()
            producer.produce(topic, key=key, value=struct.pack("q", i) + padding)
            producer.poll(0)

    with cpu_window():
        open_loop(rate, seconds, [send] * WRITERS)
        producer.flush(30)
        reader.join(60)
    done.set()
    consumer.close()
    delete_topic(bench, topic)
    warm = due[0] + WARMUP_SECONDS

    def since(starts: dict[int, float]) -> list[float]:
        return [
            (received[i] - starts[i]) * 1000 for i in received if i in starts and due[i] >= warm
        ]

    return {
        "produce_to_consume_ms": percentiles(since(produced)),
        "schedule_to_consume_ms": percentiles(since(dict(enumerate(due)))),
        "rate_per_second": round(rate, 1),
    }


def latency_cells(
    bench: Bench, *, repetitions: int, seconds: float, drain_events: int
) -> tuple[list[Cell], dict[str, Any]]:
    """R4, R4-quiet and the raw-Kafka context cell; with the drain rates and every turn's
    percentiles."""
    prefix = f"r4-{uuid.uuid4().hex[:6]}."
    topic = effects_topic(bench, prefix)
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_receipts, bench_effects"))
    restage(bench, [])
    env = {
        "ONCELY_DATABASE_URL": bench.database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bench.bootstrap,
        "ONCELY_BENCH_TOPIC_PREFIX": prefix,
        "ONCELY_BENCH_GROUP_PREFIX": prefix,
    }
    runs: dict[str, list[dict[str, Any]]] = {HALF: [], QUIET: [], RAW: []}
    argv = ["consume", "bench.effects_app:effects", "--effect", "apply"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(relay_processes(bench, 1))
        [consumer] = stack.enter_context(processes(argv, 1, env))
        wait_ready([consumer])
        pipeline = Pipeline(bench, consumer, prefix)
        pipeline.drain(1)  # the sentinel: both processes have run an event through
        drains = [pipeline.drain(drain_events) for _ in range(3)]
        drain = statistics.median(drains)
        planned = {side: max(10.0, share * drain) for side, share in LOADS.items()}
        offered, probes = {}, {}
        for side in (HALF, QUIET):
            offered[side], probes[side] = pipeline.offered_rate(planned[side], IDLE_NEEDED[side])
        offered[RAW] = offered[HALF]

        def turn(side: str) -> float:
            rate = offered[side]
            if side == RAW:
                result = raw_latency(bench, rate, seconds)
                runs[side].append(result)
                return float(result["produce_to_consume_ms"]["p99"])
            result = pipeline.latency(rate, seconds)
            runs[side].append(result)
            # The later of the two clocks: the effect row is written just before the commit.
            return float(result["commit_to_row_written_ms"]["p99"])

        sides: dict[str, Callable[[], float]] = {
            side: functools.partial(turn, side) for side in (HALF, QUIET, RAW)
        }
        run = interleave(sides, repetitions=repetitions, warmup=False)
    delete_topic(bench, topic)
    common = (
        f"relay and consumer as `oncely relay run` and `oncely consume` processes (defaults; "
        f"consumer batch {ConsumerSettings().batch_size}), {WRITER_PROCESSES} writer processes "
        f"of {WRITERS} threads (one row per transaction, own connection, prepared INSERT), open "
        "loop, "
        f"{seconds:.0f} s per turn, events due in the first {WARMUP_SECONDS:.0f} s excluded; "
        f"pipeline drain rate {drain:.0f} events/s (median of "
        f"{', '.join(f'{d:.0f}' for d in drains)}; {drain_events} rows committed at once); "
        "commit→effect = the effect row's written_at (its clock_timestamp() default, inserted "
        "just before the consumer's commit) - the writer's clock after its commit; 'receipt' "
        "uses the receipt's applied_at instead (the consumer transaction's now(), its start, "
        "earlier); absolute ms, not a ratio"
    )
    cells = []
    for name, side, target in (("R4", HALF, "< 40"), ("R4-quiet", QUIET, "< 15")):
        turns = runs[side]
        rate = offered[side]

        def med(key: str, pct: str, turns: list[dict[str, Any]] = turns) -> float:
            return round(float(statistics.median(t[key][pct] for t in turns)), 1)

        summary = (
            "p50/p95/p99 "
            + "/".join(str(med("commit_to_row_written_ms", p)) for p in ("p50", "p95", "p99"))
            + f" ms (receipt applied_at: p99 {med('commit_to_effect_ms', 'p99')} ms); "
            f"writers' lag p99 {med('writer_lag_ms', 'p99')} ms"
        )
        cell = Cell(
            name,
            side,
            [],
            "ms",
            target=target,
            measures=f"commit-to-effect p99 (absolute ms) at {LOADS[side]:.0%} of the pipeline's "
            f"drain rate ({planned[side]:.0f}/s)"
            + (
                ""
                if rate >= planned[side]
                else f", offered at {rate:.0f}/s: the most this machine carried with the writers "
                f"on schedule and {IDLE_NEEDED[side]:.0%} CPU idle"
                if probes[side][-1]["ok"]
                else f", offered at {rate:.0f}/s, the floor: no rate probed kept the writers on "
                f"schedule and {IDLE_NEEDED[side]:.0%} CPU idle"
            )
            + ", relay, consumer and writers as separate processes",
            summary=summary,
            notes=[
                common,
                f"rates probed ({PROBE_SECONDS:.0f} s each; needs writers on schedule and "
                f"{IDLE_NEEDED[side]:.0%} CPU idle): "
                + "; ".join(f"{p['rate']}/s {'ok' if p['ok'] else p['why']}" for p in probes[side]),
                "every turn (rate offered, achieved, CPU idle, p99 ms): "
                + "; ".join(
                    f"{t['rate_per_second']:.0f}/s, {t['achieved_rate_per_second']:.0f}/s, "
                    f"{t['cpu_idle']:.0%}, {t['commit_to_row_written_ms']['p99']}"
                    for t in turns
                ),
            ],
            verdict_needs_idle=True,
            idle_needed=IDLE_NEEDED[side],
        )
        behind = [t for t in turns if t["achieved_rate_per_second"] < 0.9 * rate]
        if behind:
            cell.notes.append(
                f"the writers fell behind the schedule in {len(behind)} of {len(turns)} turns "
                "(achieved_rate_per_second, writer_lag_ms): the offered load was lower than planned"
            )
        if any(t["missing"] for t in turns):
            cell.notes.append(
                "events never applied within 120 s of the last write: "
                + ", ".join(str(t["missing"]) for t in turns)
            )
        cell.take(run)
        cells.append(cell)
    raw_turns = runs[RAW]
    context = Cell(
        "R4 raw Kafka",
        RAW,
        [],
        "ms",
        target="(context)",
        measures=f"context: raw Kafka produce-to-consume p99 (absolute ms) at R4's rate "
        f"({raw_turns[0]['rate_per_second']:.0f}/s), no database, producer and consumer in "
        "the bench process",
        summary="p50/p95/p99 "
        + "/".join(
            str(round(statistics.median(t["produce_to_consume_ms"][p] for t in raw_turns), 1))
            for p in ("p50", "p95", "p99")
        )
        + " ms",
        notes=[
            "acks=all, idempotent, linger.ms=5; on a reader thread poll(0.05), then "
            "consume(499, 0): what arrived with the first record"
        ],
    )
    context.take(run)
    cells.append(context)
    details = {
        "drain_rates": [round(d, 1) for d in drains],
        "planned": {side: round(rate, 1) for side, rate in planned.items()},
        "offered": {side: round(rate, 1) for side, rate in offered.items()},
        "probes": probes,
        "runs": runs,
    }
    return cells, details
