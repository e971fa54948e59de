"""R-QUIET-CPU: CPU per event at a quiet rate (200 events/s), relay / Debezium's EventRouter.

Both sides get the same offered load, R-QUIET's: single-row outbox transactions (200 B
payloads over ``keys`` keys) committed open loop at ``RATE`` events/s by one writer thread in
the bench process (its own autocommit connection, one prepared INSERT;
:func:`bench.fixtures.commit_latency`), for ``seconds`` per turn, on a fresh topic from an
empty outbox. The sides, one at a time, interleaved, 3 repetitions after a warm-up turn each:

- **relay**: an ``oncely relay run`` process (the bench's relay settings);
- **Debezium**: a fresh EventRouter connector with ``poll.interval.ms=10`` (R-DBZ's tuned
  side, :func:`bench.debezium_cells.debezium_connector`: own slot and publication, dropped
  after the turn) in a Kafka Connect standalone worker that stays up for the whole cell.

Each turn starts its side, runs one sentinel row through it, measures the cores of its
processes over ``idle_seconds`` with nothing written (its idle baseline), then over the writes
(from the first write to the last record in Kafka). CPU per event is the cores above that
baseline times the window's length, over the events written:

- relay: the relay process tree plus every PostgreSQL process (its backends, walwriter, ...);
- Debezium: the Kafka Connect worker JVM plus every PostgreSQL process (so the walsender that
  decodes the WAL for the connector is counted).

``/proc/<pid>/stat`` ``utime + stime`` of this process's tree only
(:func:`bench.harness.cpu_window`). The writer's own CPU (the bench process) and the broker's
are not counted on either side; the writer's PostgreSQL backend is (it is the same work on both
sides), and its share is in the details (``writer_backends``) beside each side's cores above
idle by process class. Target relay / Debezium <= 1.5.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Any

from bench.debezium_cells import TUNED, connect_worker, debezium_connector, relay_side
from bench.fixtures import Bench, Side, commit_latency
from bench.harness import Cell, interleave

RATE = 200.0
WARMUP_SECONDS = 2.0
RELAY = "oncely relay"
DEBEZIUM = "Debezium EventRouter, poll.interval.ms=10"
#: The process classes (bench.harness) counted for each side.
COUNTED = {RELAY: ("relay", "postgres"), DEBEZIUM: ("kafka connect", "postgres")}


def quiet_cpu_cells(
    bench: Bench, *, repetitions: int, seconds: float, idle_seconds: float
) -> tuple[list[Cell], dict[str, Any], dict[str, str]]:
    """R-QUIET-CPU; every turn's cores (load, idle baseline) and latency; the versions."""
    events = int(RATE * seconds)
    runs: dict[str, list[dict[str, Any]]] = {RELAY: [], DEBEZIUM: []}
    with contextlib.ExitStack() as stack:
        connect, topics, versions = connect_worker(bench, stack, prefix="r-quiet-cpu-")

        def turn(name: str, side: Side) -> float:
            result = commit_latency(
                bench,
                topics,
                side,
                RATE,
                seconds,
                writers=1,
                warmup_seconds=WARMUP_SECONDS,
                idle_seconds=idle_seconds,
            )
            cpu = result["cpu"]
            above = {
                kind: cpu["load"].get(kind, 0.0) - cpu["idle"].get(kind, 0.0)
                for kind in COUNTED[name]
            }
            per_event = {
                kind: round(cores * cpu["load_seconds"] / events * 1e6, 1)
                for kind, cores in above.items()
            }
            result["cores_above_idle"] = {kind: round(v, 4) for kind, v in above.items()}
            result["cpu_us_per_event"] = per_event
            runs[name].append(result)
            return float(sum(per_event.values()))

        run = interleave(
            {
                RELAY: functools.partial(turn, RELAY, functools.partial(relay_side, bench)),
                DEBEZIUM: functools.partial(
                    turn, DEBEZIUM, functools.partial(debezium_connector, bench, connect, TUNED)
                ),
            },
            repetitions=repetitions,
        )
    measured = {name: r[-repetitions:] for name, r in runs.items()}

    def breakdown(name: str) -> str:
        return " + ".join(
            f"{kind} {statistics.median(r['cpu_us_per_event'][kind] for r in measured[name]):.0f}"
            for kind in COUNTED[name]
        )

    def writer_backend(name: str) -> float:
        return float(
            statistics.median(
                r["cpu"]["writer_backends"] * r["cpu"]["load_seconds"] / events * 1e6
                for r in measured[name]
            )
        )

    cell = Cell(
        "R-QUIET-CPU",
        RELAY,
        [DEBEZIUM],
        "µs CPU/event",
        target="<= 1.5",
        measures=f"CPU per event at {RATE:.0f} events/s above each side's idle, relay + "
        "PostgreSQL / Kafka Connect (Debezium EventRouter, poll.interval.ms=10) + PostgreSQL",
        notes=[
            f"open loop, one writer (not counted), {seconds:.0f} s per turn after an idle "
            f"baseline of {idle_seconds:.0f} s with the side running; µs per event above idle, "
            f"oncely side: {breakdown(RELAY)}; Debezium side: {breakdown(DEBEZIUM)}; the "
            "writer's PostgreSQL backend (counted in postgres on both sides, not above idle): "
            + " / ".join(f"{writer_backend(name):.0f}" for name in (RELAY, DEBEZIUM))
        ],
    )
    cell.take(run)
    return [cell], {"rate_per_second": RATE, "runs": measured}, versions
