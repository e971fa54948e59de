"""R-QUIET: commit → Kafka latency at a quiet rate (200 events/s), relay / a raw producer.

Both sides commit the same single-row outbox transactions, open loop at ``RATE`` events/s from
one writer thread (its own autocommit connection, one prepared INSERT):

- **relay**: an ``oncely relay run`` process publishes them;
- **raw producer**: the writer itself sends each event right after its commit, with a producer
  configured as the relay's (compression, ``acks=all``, idempotence) and sending at once
  (``linger.ms=0``, as a quiet relay sends each read's records at once); no relay runs. This is
  the best a service could do by producing in its request path.

commit → Kafka is the record's broker append time (``LogAppendTime`` topic) minus the writer's
clock right after its commit returned. p50 and p99 are two cells (targets <= 1.2 and <= 1.5); events
due in the first ``WARMUP_SECONDS`` are left out; the sides are interleaved, 3 repetitions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from bench.cells import raw_producer
from bench.fixtures import Bench, Side, Topics, commit_latency, relay_processes
from bench.harness import Cell, interleave
from oncely.storage.stores.outbox.rows import OutboxRow

RATE = 200.0
WARMUP_SECONDS = 2.0
RELAY = "relay"
RAW = "raw producer after each commit"


def quiet_cells(bench: Bench, *, repetitions: int, seconds: float) -> tuple[list[Cell], Any]:
    """R-QUIET p50 and p99, and the percentiles of every run."""
    topics = Topics(bench)
    runs: dict[str, list[dict[str, Any]]] = {RELAY: [], RAW: []}

    @contextlib.contextmanager
    def relay() -> Iterator[None]:
        with relay_processes(bench, 1):
            yield

    producers: list[Any] = []

    def produce(topic: str) -> Callable[[dict[str, Any]], None]:
        producer = raw_producer(bench, linger_ms=0)
        producer.list_topics(topic, timeout=30)
        producers.append(producer)

        def send(row: dict[str, Any]) -> None:
            now = datetime.now(UTC)
            record = OutboxRow(
                str(row["id"]),
                0,
                0,
                topic,
                row["aggregateid"],
                row["type"],
                row["payload"],
                tuple((name, str(value).encode()) for name, value in row["headers"].items()),
                int(now.timestamp() * 1_000_000),
            )
            producer.produce(
                topic, key=record.key, value=record.payload, headers=record.kafka_headers()
            )
            producer.poll(0)

        return send

    def measure(name: str, side: Side, raw: bool) -> tuple[float, float]:
        result = commit_latency(
            bench,
            topics,
            side,
            RATE,
            seconds,
            writers=1,
            warmup_seconds=WARMUP_SECONDS,
            produce=produce if raw else None,
        )
        for producer in producers:
            producer.flush(30)
        producers.clear()
        runs[name].append(result)
        latency = result["commit_to_kafka_ms"]
        return float(latency["p50"]), float(latency["p99"])

    values: dict[str, list[tuple[float, float]]] = {RELAY: [], RAW: []}

    def turn(name: str, side: Side, raw: bool) -> float:
        values[name].append(measure(name, side, raw))
        return values[name][-1][1]

    try:
        run = interleave(
            {
                RELAY: functools.partial(turn, RELAY, relay, False),
                RAW: functools.partial(turn, RAW, contextlib.nullcontext, True),
            },
            repetitions=repetitions,
        )
    finally:
        topics.close()
    cells = []
    for index, label, target in ((0, "p50", "<= 1.2"), (1, "p99", "<= 1.5")):
        cell = Cell(
            f"R-QUIET {label}",
            RELAY,
            [RAW],
            "ms",
            target=target,
            measures=f"commit-to-Kafka {label} at {RATE:.0f} events/s, relay / a raw producer "
            "sending each event right after its commit (the relay's producer settings, "
            "linger.ms=0)",
            notes=[
                f"open loop, one writer, {seconds:.0f} s per turn, events due in the first "
                f"{WARMUP_SECONDS:.0f} s excluded"
            ],
        )
        # The warm-up turn of each side is not reported.
        measured = {name: v[-repetitions:] for name, v in values.items()}
        cell.take(
            run, values={name: [pair[index] for pair in pairs] for name, pairs in measured.items()}
        )
        cells.append(cell)
    return cells, {name: r[-repetitions:] for name, r in runs.items()}
