"""The relay's cells, measured in one interleaved run over the same backlog:

- **R1** relay / a raw producer (the relay's producer settings) sending the same records a page
  at a time, waiting for each page (batch and wait);
- **R2** relay / its own read + progress SQL alone (``RelayStore.snapshot/read/record`` in the
  relay's page loop, no Kafka);
- **R2-xmin** relay drain with a REPEATABLE READ transaction held open (it has run a query and
  has a transaction id, so every snapshot's ``xmin`` stays at it) / without;
- **R-HOT** relay drain with every row on one key / over ``keys`` keys;
- **R7** two relay processes / one, the CPU idle of each run reported.

Every relay side is ``oncely relay run`` processes (the bench's relay settings), started, ready
and sharing the shards evenly before the rows are committed in one transaction; the rate is
from that commit to the last record's broker append time (``LogAppendTime`` topics).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import psycopg
from confluent_kafka import Producer

from bench.fixtures import (
    PAYLOAD,
    Bench,
    Side,
    Topics,
    commit_at_once,
    drain_rate,
    relay_processes,
    restage,
    staged_rows,
)
from bench.harness import Cell, cpu_window, interleave
from oncely.relay.publisher import REQUIRED
from oncely.relay.service import producer_config
from oncely.settings import KafkaSettings, RelaySettings
from oncely.storage.stores.outbox.relay import Progress, RelayStore, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
from oncely.testing.services import libpq_dsn

RELAY = "relay"
RAW = "raw producer, batch and wait"
SQL = "read + progress SQL alone"
XMIN = "relay, REPEATABLE READ transaction held open"
HOT = "relay, every row on one key"
TWO = "2 relay processes"

#: Which sides each cell needs (the relay side is shared).
NEEDS = {"R1": [RAW], "R2": [SQL], "R2-xmin": [XMIN], "R-HOT": [HOT], "R7": [TWO]}

Record = tuple[str, bytes, bytes, list[tuple[str, str | bytes | None]]]


def _records(rows: list[dict[str, object]], topic: str) -> list[Record]:
    """The Kafka records the relay would send for ``rows``, built before any timing."""
    records = []
    now = datetime.now(UTC)
    for seq, row in enumerate(rows, 1):
        outbox_row = OutboxRow(
            event_id=str(uuid.uuid4()),
            seq=seq,
            shard=0,
            topic=topic,
            aggregateid=str(row["aggregateid"]),
            type=str(row["type"]),
            payload=PAYLOAD,
            headers=tuple(
                (name, str(value).encode())
                for name, value in row["headers"].items()  # type: ignore[attr-defined]
            ),
            created_us=int(now.timestamp() * 1_000_000),
        )
        records.append((topic, outbox_row.key, outbox_row.payload, outbox_row.kafka_headers()))
    return records


def raw_producer(bench: Bench, *, linger_ms: int | None = None) -> Producer:
    """A producer with exactly the relay's settings (linger, compression, acks, idempotence);
    ``linger_ms`` in place of the relay's busy linger."""
    settings = bench.relay_settings()
    config = producer_config(KafkaSettings(bootstrap_servers=bench.bootstrap), settings)
    if linger_ms is not None:
        config["linger.ms"] = linger_ms
    return Producer({**config, **REQUIRED})


def _raw_batches(bench: Bench, topics: Topics, rows: list[dict[str, object]]) -> float:
    """Rows/s of a raw producer sending a page of records, then waiting for all of it."""
    topic = topics.new()
    records = _records(rows, topic)
    producer = raw_producer(bench)
    producer.list_topics(topic, timeout=30)
    with cpu_window():
        started = time.perf_counter()
        for start in range(0, len(records), bench.batch_size):
            for name, key, value, headers in records[start : start + bench.batch_size]:
                while True:
                    try:
                        producer.produce(name, key=key, value=value, headers=headers)
                        break
                    except BufferError:
                        producer.poll(0.05)
            producer.flush(60)
        elapsed = time.perf_counter() - started
    return len(records) / elapsed


def _sql_alone(bench: Bench, topics: Topics, rows: list[dict[str, object]]) -> float:
    """Rows/s of the relay's own statements over the same backlog, no Kafka: lease every shard,
    then per turn of the loop one snapshot, one page read per group of shards at the same
    position, and one progress write, as the relay's loop does."""
    topic = topics.new()
    restage(bench, [])
    store = RelayStore(bench.engine, owner=f"bench-sql-{uuid.uuid4().hex[:6]}")
    leases = store.acquire(wanted=10_000, lease_seconds=600)
    try:
        if len(leases) < len(store.shards()):
            raise RuntimeError("the SQL-alone side needs every shard free (a relay still runs?)")
        cursors = {lease.shard: lease.progress for lease in leases}
        epochs = {lease.shard: lease.epoch for lease in leases}
        sizes = {lease.shard: bench.batch_size for lease in leases}
        cap = max(bench.batch_size, RelaySettings().max_in_flight // 2)
        committed = commit_at_once(bench, rows, topic)
        deadline = time.monotonic() + 600
        pages: list[list[OutboxRow]] = []
        with cpu_window():
            read = 0
            while read < len(rows):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the SQL-alone loop read {read} of {len(rows)} rows")
                groups: dict[Progress, list[int]] = {}
                for shard, cursor in cursors.items():
                    groups.setdefault(cursor, []).append(shard)
                fresh: Snapshot | None = None
                progress: list[ShardProgress] = []
                for cursor, members in groups.items():
                    if cursor.reading is None and fresh is None:
                        fresh, _ = store.snapshot()
                    reading = cursor.reading or fresh
                    assert reading is not None
                    size = min(sizes[s] for s in members)
                    page = store.read(
                        members,
                        done=cursor.done,
                        reading=reading,
                        after_seq=cursor.after_seq,
                        page_size=size,
                    )
                    if len(page) < size:
                        ends = Progress(reading)
                    else:
                        ends = Progress(cursor.done, reading, page[-1].seq)
                    for shard in members:  # pages double while full, as in the relay's loop
                        sizes[shard] = min(cap, size * 2) if len(page) == size else bench.batch_size
                    read += len(page)
                    pages.append(page)
                    for shard in members:
                        cursors[shard] = ends
                    progress += [ShardProgress(s, epochs[s], ends) for s in members]
                store.record(progress)
            elapsed = time.time() - committed
        distinct = len({row.id for page in pages for row in page})
        if distinct != len(rows):  # the denominator must read each row exactly once
            raise RuntimeError(f"the SQL-alone loop read {read} rows, {distinct} distinct")
    finally:
        store.release([(lease.shard, lease.epoch) for lease in leases])
        store.close()
    return len(rows) / elapsed


@contextlib.contextmanager
def _snapshot_held(bench: Bench) -> Iterator[None]:
    """A REPEATABLE READ transaction open for the block: it has run a query (so it holds a
    snapshot) and has a transaction id (so it is in every snapshot's in-progress list and
    holds ``xmin``). It touches no table, so the outbox can still be truncated."""
    with psycopg.connect(libpq_dsn(bench.database_url)) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT pg_current_xact_id()")
        try:
            yield
        finally:
            conn.rollback()


def _relay_side(bench: Bench, count: int = 1, *, hold: bool = False) -> Side:
    @contextlib.contextmanager
    def side() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if hold:
                stack.enter_context(_snapshot_held(bench))
            stack.enter_context(relay_processes(bench, count))
            yield

    return side


def relay_cells(bench: Bench, *, repetitions: int, cells: list[str]) -> list[Cell]:
    """The requested cells among R1, R2, R2-xmin, R-HOT and R7, measured in one interleaved run."""
    topics = Topics(bench)
    try:
        rows = staged_rows(bench.rows, topic="(set per turn)", keys=bench.keys)
        hot = staged_rows(bench.rows, topic="(set per turn)", keys=1)
        available: dict[str, Callable[[], float]] = {
            RELAY: functools.partial(drain_rate, bench, topics, _relay_side(bench), rows),
            RAW: functools.partial(_raw_batches, bench, topics, rows),
            SQL: functools.partial(_sql_alone, bench, topics, rows),
            XMIN: functools.partial(drain_rate, bench, topics, _relay_side(bench, hold=True), rows),
            HOT: functools.partial(drain_rate, bench, topics, _relay_side(bench), hot),
            TWO: functools.partial(drain_rate, bench, topics, _relay_side(bench, 2), rows),
        }
        wanted = [RELAY] + [side for cell in cells for side in NEEDS[cell]]
        run = interleave(
            {side: available[side] for side in available if side in wanted},
            repetitions=repetitions,
        )
    finally:
        topics.close()
    note = (
        f"{bench.rows} rows of 200 B over {bench.keys} keys committed in one transaction while "
        f"the side runs; relay page {bench.batch_size}; rate from the commit to the last "
        "record's LogAppendTime"
    )
    made = {
        "R1": Cell(
            "R1",
            RELAY,
            [RAW],
            "rows/s",
            target=">= 0.5",
            measures="drain rate, relay / a raw producer sending the same records a page at a "
            "time and waiting for each page (the relay's producer settings)",
        ),
        "R2": Cell(
            "R2",
            RELAY,
            [SQL],
            "rows/s",
            target=">= 0.9",
            measures="drain rate, relay / its own read + progress statements alone "
            "(RelayStore.snapshot/read/record in the relay's page loop, no Kafka)",
        ),
        "R2-xmin": Cell(
            "R2-xmin",
            XMIN,
            [RELAY],
            "rows/s",
            target=">= 0.8",
            measures="drain rate with a REPEATABLE READ transaction (with a snapshot and a "
            "txid) held open from before the rows were committed / without",
        ),
        "R-HOT": Cell(
            "R-HOT",
            HOT,
            [RELAY],
            "rows/s",
            target=">= 0.8",
            measures=f"relay drain rate, every row on one key / over {bench.keys} keys",
        ),
        "R7": Cell(
            "R7",
            TWO,
            [RELAY],
            "rows/s",
            target=">= 1.0",
            measures="drain rate, 2 `oncely relay run` processes / 1 (CPU idle of each run "
            "beside it)",
        ),
    }
    result = []
    for name in cells:
        cell = made[name]
        cell.notes.append(note)
        cell.take(run)
        result.append(cell)
    return result
