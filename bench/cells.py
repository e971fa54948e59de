"""The benchmark cells (see ``bench/README.md`` for what each compares and why)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from confluent_kafka import Producer

from bench.fixtures import PAYLOAD, Bench, relays, restage, staged_rows, wait_published
from bench.harness import Cell, alternate
from oncely.devstack.postgres import postgres_bin_dir
from oncely.relay.records import ClaimedRow
from oncely.relay.store import OutboxStore, Published
from oncely.storage.queries import _load as load_queries


def _relay_drain(bench: Bench, rows: list[dict[str, object]], *, count: int = 1) -> float:
    restage(bench, rows)
    started = time.perf_counter()
    with relays(bench, count):
        wait_published(bench, len(rows))
    return len(rows) / (time.perf_counter() - started)


def _sql_alone(bench: Bench, rows: list[dict[str, object]]) -> float:
    """The relay's own claim + settle statements, with a fake broker that confirms at once."""
    restage(bench, rows)
    store = OutboxStore(bench.engine, owner="bench-sql")
    started = time.perf_counter()
    done, offset = 0, 0
    while done < len(rows):
        claimed = store.claim(batch_size=bench.batch_size, lease_seconds=60)
        result = store.mark_published(
            [Published(row, 0, offset + i) for i, row in enumerate(claimed)], delete=False
        )
        offset += len(claimed)
        done += result.settled
    return len(rows) / (time.perf_counter() - started)


Record = tuple[str, bytes, bytes, list[tuple[str, str | bytes | None]]]


def _records(rows: list[dict[str, object]]) -> list[Record]:
    """The Kafka records the relay would send for ``rows``, built before any timing."""
    records = []
    for row in rows:
        claimed = ClaimedRow(
            id=row["id"],  # type: ignore[arg-type]
            seq=0,
            topic=str(row["topic"]),
            aggregateid=str(row["aggregateid"]),
            type=str(row["type"]),
            payload=PAYLOAD,
            headers=row["headers"],  # type: ignore[arg-type]
            attempts=1,
            created_at=datetime.now(UTC),
        )
        records.append((claimed.topic, claimed.key, claimed.payload, claimed.kafka_headers()))
    return records


def _raw_producer(bench: Bench, records: list[Record], *, batch: int | None) -> float:
    producer = Producer(
        {
            "bootstrap.servers": bench.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "compression.type": "lz4",
        }
    )
    started = time.perf_counter()
    step = batch or len(records)
    for start in range(0, len(records), step):
        for topic, key, value, headers in records[start : start + step]:
            while True:
                try:
                    producer.produce(topic, key=key, value=value, headers=headers)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.flush(60)
    return len(records) / (time.perf_counter() - started)


def relay_cells(bench: Bench, *, repetitions: int) -> list[Cell]:
    """R1 (relay vs raw producer), R2 (relay vs its SQL alone) and R7 (two relays vs one)."""
    topic = bench.new_topic()
    rows = staged_rows(bench.rows, topic=topic, keys=bench.keys)
    records = _records(rows)
    rates = alternate(
        {
            "relay": lambda: _relay_drain(bench, rows),
            "raw producer, fire then flush": lambda: _raw_producer(bench, records, batch=None),
            "raw producer, batch and wait": lambda: _raw_producer(
                bench, records, batch=bench.batch_size
            ),
            "claim + settle SQL alone": lambda: _sql_alone(bench, rows),
            "2 relays": lambda: _relay_drain(bench, rows, count=2),
        },
        repetitions=repetitions,
        warmup=False,
    )
    note = f"{bench.rows} rows of 200 B over {bench.keys} keys, batch {bench.batch_size}"
    r1 = Cell(
        "R1",
        "relay",
        ["raw producer, fire then flush", "raw producer, batch and wait"],
        "rows/s",
        target="(context: the broker's limit)",
        notes=[note],
    )
    r2 = Cell("R2", "relay", ["claim + settle SQL alone"], "rows/s", target=">= 0.9", notes=[note])
    r7 = Cell("R7", "2 relays", ["relay"], "rows/s", target=">= 1.2", notes=[note])
    for cell in (r1, r2, r7):
        cell.rates = {side: rates[side] for side in (cell.numerator, *cell.denominators)}
    return [r1, r2, r7]


def pgbench_claim(bench: Bench, *, repetitions: int) -> Cell:
    """R2b: the claim statement alone from pgbench (a C client), to separate driver cost."""
    topic = bench.new_topic()
    rows = staged_rows(bench.rows, topic=topic, keys=bench.keys)
    claim = load_queries()["outbox_claim"]
    script = (
        claim.replace(":owner", "'pgbench'")
        .replace(":batch_size", str(bench.batch_size))
        .replace(":lease_seconds", "3600")
    )
    # pgbench runs each line as a statement: one line, ending with a semicolon.
    script_file = Path(tempfile.mkdtemp()) / "claim.sql"
    script_file.write_text(" ".join(line.split("--")[0] for line in script.splitlines()) + ";\n")
    url = bench.engine.url
    transactions = bench.rows // bench.batch_size

    def python_claim() -> float:
        restage(bench, rows)
        store = OutboxStore(bench.engine, owner="bench-claim")
        started = time.perf_counter()
        for _ in range(transactions):
            store.claim(batch_size=bench.batch_size, lease_seconds=3600)
        return transactions * bench.batch_size / (time.perf_counter() - started)

    def c_claim() -> float:
        restage(bench, rows)
        started = time.perf_counter()
        subprocess.run(
            [
                str(postgres_bin_dir() / "pgbench"),
                "-n",
                "-f",
                str(script_file),
                "-t",
                str(transactions),
                "-h",
                str(url.host),
                "-p",
                str(url.port),
                "-U",
                str(url.username),
                str(url.database),
            ],
            check=True,
            capture_output=True,
        )
        return transactions * bench.batch_size / (time.perf_counter() - started)

    cell = Cell("R2b", "claim from Python (psycopg)", ["claim from pgbench (C)"], "rows/s")
    cell.rates = alternate(
        {"claim from Python (psycopg)": python_claim, "claim from pgbench (C)": c_claim},
        repetitions=repetitions,
        warmup=False,
    )
    cell.notes.append("pgbench time includes its process start (a few ms)")
    return cell
