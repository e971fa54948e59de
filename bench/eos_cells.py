"""The relay's exactly-once mode (``ONCELY_RELAY_EXACTLY_ONCE=true``) against its default, at
least once, each side an ``oncely relay run`` process with the bench's relay settings; every
time is when a ``read_committed`` consumer (:func:`bench.fixtures.read_committed`) returned the
record, so that a record of an exactly-once page counts once its transaction committed:

- **R-EOS** drain rate over the rows and topic layout of R1's drain (rows committed in one
  transaction, then to the last of them visible), exactly once / at least once;
- **R-EOS-QUIET** commit → visible p50 and p99 at 200 events/s (R-QUIET's open-loop writer);
- **R-EOS-RECOVER** seconds from a relay's SIGKILL mid-drain to the first record a new relay
  process (started right after the kill) makes visible; bounded below by the lease's expiry;
- **R-EOS-OPEN** what open transactions cost the other producers of the same partitions: a
  plain (non-transactional) producer sends to every partition of the topic while the relay
  drains; broker append → visible p50 and p99 of its records appended during the drain (a
  ``read_committed`` reader gets no record behind an open transaction's first offset, the last
  stable offset, before that transaction ends).

Exactly-once sides use a transactional id prefix of their own each turn, with its progress
topic, so that no turn fences or follows another's producers.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka.admin import NewTopic

from bench.cells import raw_producer
from bench.fixtures import (
    Bench,
    Side,
    Topics,
    commit_at_once,
    commit_latency,
    drain_rate,
    percentiles,
    processes,
    read_committed,
    relay_processes,
    restage,
    sentinel,
    staged_rows,
    wait_ready,
)
from bench.harness import Cell, Run, cpu_window, interleave
from oncely.settings import RelaySettings, TopicSettings
from oncely.topics import progress_topic_spec

EOS = "relay, exactly once"
ALO = "relay, at least once"
QUIET_RATE = 200.0
QUIET_WARMUP_SECONDS = 2.0
#: The plain producer's rate beside the draining relay (R-EOS-OPEN), records/s.
OPEN_RATE = 500.0
#: Records appended this soon after the SIGKILL may be the killed relay's last requests.
KILL_MARGIN_SECONDS = 0.5
#: At least this many rows in R-EOS-RECOVER's backlog, so the kill lands mid-drain.
RECOVER_ROWS = 20_000


def _env(bench: Bench, topics: Topics, *, exactly_once: bool) -> dict[str, str]:
    """The relay's environment for one turn: at least once as the bench runs it, or exactly
    once with a fresh transactional id prefix and its progress topic (deleted with ``topics``)."""
    if not exactly_once:
        return {}
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    spec = progress_topic_spec(prefix, TopicSettings())
    made = NewTopic(spec.name, num_partitions=spec.partitions, config=dict(spec.config))
    topics.admin.create_topics([made])[spec.name].result(30)
    topics.created.append(spec.name)
    return {"ONCELY_RELAY_EXACTLY_ONCE": "true", "ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX": prefix}


def _relay(bench: Bench, topics: Topics, *, exactly_once: bool) -> Side:
    @contextlib.contextmanager
    def side() -> Iterator[None]:
        with relay_processes(bench, 1, env=_env(bench, topics, exactly_once=exactly_once)):
            yield

    return side


def _sides(make: Callable[..., float]) -> dict[str, Callable[[], float]]:
    return {
        EOS: functools.partial(make, exactly_once=True),
        ALO: functools.partial(make, exactly_once=False),
    }


def _percentile_cells(
    run: Run, measured: dict[str, list[dict[str, Any]]], figure: str, made: Callable[[str], Cell]
) -> list[Cell]:
    """A p99 and a p50 cell, each ``made(label)``, whose values are that percentile of each
    measured turn's ``figure``."""
    cells = []
    for label in ("p99", "p50"):
        cell = made(label)
        values = {
            side: [float(turn[figure][label]) for turn in turns] for side, turns in measured.items()
        }
        cell.take(run, values=values)
        cells.append(cell)
    return cells


def drain_cell(bench: Bench, topics: Topics, *, repetitions: int) -> Cell:
    """R-EOS: the drain rate to the last row visible, exactly once / at least once."""
    rows = staged_rows(bench.rows, topic="(set per turn)", keys=bench.keys)

    def drain(*, exactly_once: bool) -> float:
        side = _relay(bench, topics, exactly_once=exactly_once)
        return drain_rate(bench, topics, side, rows, visible=True)

    cell = Cell(
        "R-EOS",
        EOS,
        [ALO],
        "rows/s",
        target=">= 0.85",
        measures="drain rate to the last row visible to a read_committed consumer, relay "
        "exactly once / at least once (R1's rows and topic layout)",
        notes=[
            f"{bench.rows} rows of 200 B over {bench.keys} keys committed in one transaction "
            f"while the side runs, {bench.partitions} partitions; relay page {bench.batch_size}; "
            "rate from the commit to the moment a read_committed consumer (fetch.wait.max.ms "
            "10, in the bench process) returned the last row"
        ],
    )
    cell.measure(_sides(drain), repetitions=repetitions)
    return cell


def quiet_cells(
    bench: Bench, topics: Topics, *, repetitions: int, seconds: float
) -> tuple[list[Cell], dict[str, list[dict[str, Any]]]]:
    """R-EOS-QUIET p50 and p99: commit → visible at 200 events/s, and every turn's figures."""
    runs: dict[str, list[dict[str, Any]]] = {EOS: [], ALO: []}

    def turn(*, exactly_once: bool) -> float:
        result = commit_latency(
            bench,
            topics,
            _relay(bench, topics, exactly_once=exactly_once),
            QUIET_RATE,
            seconds,
            writers=1,
            warmup_seconds=QUIET_WARMUP_SECONDS,
            visible=True,
        )
        runs[EOS if exactly_once else ALO].append(result)
        return float(result["commit_to_visible_ms"]["p99"])

    run = interleave(_sides(turn), repetitions=repetitions)
    measured = {side: results[-repetitions:] for side, results in runs.items()}

    def made(label: str) -> Cell:
        return Cell(
            "R-EOS-QUIET" if label == "p99" else f"R-EOS-QUIET {label}",
            EOS,
            [ALO],
            "ms",
            target="<= 2.0" if label == "p99" else "reported",
            measures=f"commit → visible to a read_committed consumer, {label} at "
            f"{QUIET_RATE:.0f} events/s, relay exactly once / at least once",
            notes=[
                f"open loop, one writer, {seconds:.0f} s per turn, events due in the first "
                f"{QUIET_WARMUP_SECONDS:.0f} s excluded; visible: returned by a read_committed "
                "consumer (fetch.wait.max.ms 10) in the bench process"
            ],
        )

    return _percentile_cells(run, measured, "commit_to_visible_ms", made), measured


def recover_cell(
    bench: Bench, topics: Topics, *, repetitions: int
) -> tuple[Cell, dict[str, list[dict[str, Any]]]]:
    """R-EOS-RECOVER: SIGKILL mid-drain → first record visible from a new relay process."""
    rows = staged_rows(max(bench.rows, RECOVER_ROWS), topic="(set per turn)", keys=bench.keys)
    lease = RelaySettings().lease_seconds
    runs: dict[str, list[dict[str, Any]]] = {EOS: [], ALO: []}

    def turn(*, exactly_once: bool) -> float:
        topic = topics.new()
        restage(bench, [])
        env = {**bench.relay_env(), **_env(bench, topics, exactly_once=exactly_once)}
        with read_committed(bench, topic) as seen:
            with processes(["relay", "run"], 1, env) as [victim]:
                wait_ready([victim])
                commit_at_once(bench, rows, topic)
                if not seen.wait(1, timeout=120):
                    raise TimeoutError(f"the relay never published to {topic}")
                victim.proc.send_signal(signal.SIGKILL)
                killed = time.time()
                victim.proc.wait()
            before = len(seen.at)
            with processes(["relay", "run"], 1, env), cpu_window():
                if not seen.wait(len(rows), timeout=600):
                    raise TimeoutError(f"only {len(seen.at)} of {len(rows)} rows visible")
        after = [at for at, appended in seen.at.values() if appended > killed + KILL_MARGIN_SECONDS]
        if before >= len(rows) or not after:
            raise RuntimeError("the relay drained every row before the kill: nothing measured")
        runs[EOS if exactly_once else ALO].append(
            {
                "visible_before_kill": before,
                "rows": len(rows),
                "duplicates": seen.records - len(seen.at),
                "drained_after_kill_s": round(max(after) - killed, 2),
            }
        )
        return min(after) - killed

    run = interleave(_sides(turn), repetitions=repetitions)
    cell = Cell(
        "R-EOS-RECOVER",
        EOS,
        [ALO],
        "s",
        target="reported",
        measures="SIGKILL of a relay mid-drain → first record a new relay process makes "
        "visible to a read_committed consumer, exactly once / at least once",
        notes=[
            f"lease {lease:g} s (the relay's default), renewed every third of it: the new "
            f"process takes the shards only once the killed one's leases expire, {2 * lease / 3:g}"
            f" to {lease:g} s after the kill, so no side recovers faster than that; the new "
            "process is spawned right after the kill (its start-up overlaps the wait); "
            f"{len(rows)} rows committed at once, the kill after the first of them is visible"
        ],
    )
    cell.take(run)
    return cell, {side: results[-repetitions:] for side, results in runs.items()}


def open_cells(
    bench: Bench, topics: Topics, *, repetitions: int
) -> tuple[list[Cell], dict[str, list[dict[str, Any]]]]:
    """R-EOS-OPEN p50 and p99: a plain producer's append → visible beside a draining relay."""
    rows = staged_rows(bench.rows, topic="(set per turn)", keys=bench.keys)
    runs: dict[str, list[dict[str, Any]]] = {EOS: [], ALO: []}

    def turn(*, exactly_once: bool) -> float:
        topic = topics.new()
        restage(bench, [])
        producer = raw_producer(bench, linger_ms=0)
        producer.list_topics(topic, timeout=30)
        stop, plain_ids = threading.Event(), list[str]()

        def plain() -> None:
            sent, started = 0, time.perf_counter()
            while not stop.is_set():
                plain_ids.append(f"plain-{uuid.uuid4()}")
                headers: list[tuple[str, str | bytes | None]] = [("id", plain_ids[-1])]
                partition = sent % bench.partitions
                producer.produce(topic, value=b"x" * 200, partition=partition, headers=headers)
                producer.poll(0)
                sent += 1
                time.sleep(max(0.0, started + sent / OPEN_RATE - time.perf_counter()))

        with _relay(bench, topics, exactly_once=exactly_once)():
            sentinel(bench, topics, topic)
            with read_committed(bench, topic) as seen:
                writer = threading.Thread(target=plain)
                writer.start()
                try:
                    time.sleep(0.5)
                    committed = commit_at_once(bench, rows, topic)
                    deadline = time.monotonic() + 600
                    with cpu_window():  # until the sentinel and every row are visible
                        while len(seen.at) - sum(i in seen.at for i in plain_ids) <= len(rows):
                            if time.monotonic() > deadline:
                                raise TimeoutError(f"the drain into {topic} never ended")
                            time.sleep(0.02)
                    drained = max(  # a copy: the reader thread goes on adding
                        at for i, (at, _) in list(seen.at.items()) if not i.startswith("plain-")
                    )
                finally:
                    stop.set()
                    writer.join()
                    producer.flush(30)
        waits = [
            (at - appended) * 1000
            for event_id, (at, appended) in seen.at.items()
            if event_id.startswith("plain-") and committed <= appended <= drained
        ]
        result: dict[str, Any] = {
            "append_to_visible_ms": percentiles(waits),
            "plain_records_measured": len(waits),
            "drain_seconds": round(drained - committed, 2),
        }
        runs[EOS if exactly_once else ALO].append(result)
        return float(result["append_to_visible_ms"]["p99"])

    run = interleave(_sides(turn), repetitions=repetitions)
    measured = {side: results[-repetitions:] for side, results in runs.items()}

    def made(label: str) -> Cell:
        return Cell(
            f"R-EOS-OPEN {label}",
            EOS,
            [ALO],
            "ms",
            target="reported",
            measures=f"what open transactions cost a plain producer on the same partitions: "
            f"broker append → visible to a read_committed consumer, {label}, while the relay "
            "drains, exactly once / at least once",
            notes=[
                f"a plain (non-transactional) producer sends 200 B records at {OPEN_RATE:.0f}/s "
                f"round-robin over the {bench.partitions} partitions while the relay drains "
                f"{bench.rows} rows committed at once; its records appended between that commit "
                "and the last relayed row visible are measured"
            ],
        )

    return _percentile_cells(run, measured, "append_to_visible_ms", made), measured


def eos_cells(
    bench: Bench, *, repetitions: int, cells: list[str], seconds: float
) -> tuple[list[Cell], dict[str, Any]]:
    """The requested cells among R-EOS, R-EOS-QUIET, R-EOS-RECOVER and R-EOS-OPEN (each its
    own interleaved run), and the figures of every turn."""
    topics = Topics(bench)
    made: list[Cell] = []
    details: dict[str, Any] = {}
    try:
        if "R-EOS" in cells:
            made.append(drain_cell(bench, topics, repetitions=repetitions))
        if "R-EOS-QUIET" in cells:
            quiet, details["R-EOS-QUIET runs"] = quiet_cells(
                bench, topics, repetitions=repetitions, seconds=seconds
            )
            made += quiet
        if "R-EOS-RECOVER" in cells:
            recover, details["R-EOS-RECOVER runs"] = recover_cell(
                bench, topics, repetitions=repetitions
            )
            made.append(recover)
        if "R-EOS-OPEN" in cells:
            opened, details["R-EOS-OPEN runs"] = open_cells(bench, topics, repetitions=repetitions)
            made += opened
    finally:
        topics.close()
    return made, details
