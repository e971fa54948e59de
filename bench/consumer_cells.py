"""The consumer's throughput cells, and its memory under a backlog.

R3, R3-fair and R3-dup are measured in one interleaved run over the same topic of ``count``
``credited`` records (Avro, ``keys`` keys, 6 partitions, produced once before the run):

- **consumer with receipts**: the ``apply`` effect of :mod:`bench.effects_app` (one
  ``ctx.insert`` row per event) on a thread of this process, a fresh group, receipts and
  effect rows truncated first; records/s from the group's join to the last record applied;
- **replay**: right after it, a second fresh group on the same effect name, receipts kept:
  every record is a duplicate (R3-dup = its rate / the first application's);
- **raw + same rows (psycopg)**: a raw ``confluent_kafka.Consumer`` that per batch decodes
  each value with fastavro, then in one psycopg transaction (pipeline mode: BEGIN, two
  statements and COMMIT in one round trip) inserts the same receipt rows into
  ``oncely_receipts`` (``ON CONFLICT DO NOTHING``) and the same effect rows, one ``unnest``
  INSERT per table with the columns as arrays, commits, then stores and commits the offsets
  (R3-fair);
- **raw + empty transaction**: the same consumer opening and committing one empty
  transaction per batch (R3), and **raw, counting** (context).

R-LANES: the ``wait`` effect (2 ms ``time.sleep`` per record, then its row) with
``ONCELY_CONSUMER_LANES`` 8 / 1 (the ``lanes`` consumer setting), over ``keys`` keys.

R-RSS: one ``oncely consume`` process applying a backlog of ``records`` records produced to a
fresh topic first (a replay from a fresh group): its resident set size sampled as it goes
(``/proc/<pid>/status`` ``VmRSS``) at 10%, 50% and 90% of the backlog, and its peak
(``VmHWM``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import NewTopic
from fastavro import parse_schema, schemaless_reader

from bench.effects_app import build_effects, create_effects_table
from bench.fixtures import Bench, delete_topic, memory_mb, metric, processes, wait_ready
from bench.harness import Cell, cpu_window, interleave
from oncely.consumers.effects import Effects
from oncely.consumers.runner import EffectConsumer
from oncely.consumers.service import build_consumers
from oncely.runtime.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.settings import ConsumerSettings, KafkaSettings
from oncely.testing.services import libpq_dsn

OURS = "consumer with receipts (ctx.insert)"
REPLAY = "replay of records already applied (fresh group, receipts kept)"
FAIR = "raw consumer + the same receipt and effect rows per batch (psycopg)"
EMPTY = "raw consumer + empty transaction and commit per batch"
COUNTING = "raw consumer, counting"
LANES_8, LANES_1 = "8 lanes", "1 lane"

#: Which sides each cell needs (the consumer with receipts is shared).
NEEDS = {"R3": [EMPTY, COUNTING], "R3-fair": [FAIR], "R3-dup": [REPLAY]}
#: Where the R-RSS samples are reported, as shares of the backlog.
RSS_POINTS = (0.1, 0.5, 0.9)

_RECEIPTS = (
    'INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset") '
    'SELECT r.event_id, %s::text, r.topic, r.partition, r."offset" FROM unnest('
    '%s::uuid[], %s::text[], %s::int[], %s::bigint[]) AS r (event_id, topic, partition, "offset") '
    "ON CONFLICT ON CONSTRAINT oncely_receipts_pkey DO NOTHING"
)
_EFFECTS = (
    "INSERT INTO bench_effects (event_id, amount) SELECT * FROM unnest(%s::uuid[], %s::int[])"
)


def produce(bench: Bench, effects: Effects, count: int) -> None:
    """``count`` ``credited`` records on the app's topic over ``bench.keys`` keys, each with
    its own event id, as the relay sends them (``id``, ``eventType`` and the codec's headers)."""
    codec = Codec(registry=effects.registry)
    [event_type] = effects.get("apply").event_types
    values = [
        codec.encode(event_type.model(account=f"acc-{k}", amount=k)) for k in range(bench.keys)
    ]
    producer = Producer({"bootstrap.servers": bench.bootstrap, "linger.ms": 20})
    for i in range(count):
        key = i % bench.keys
        value, headers = values[key]
        while True:
            try:
                producer.produce(
                    event_type.topic,
                    key=f"acc-{key}".encode(),
                    value=value,
                    headers=[
                        ("id", str(uuid.uuid4())),
                        ("eventType", "credited"),
                        *headers.items(),
                    ],
                )
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)


def _new_app(bench: Bench, prefix: str) -> tuple[Effects, str]:
    """An app with its own topic (``bench.partitions`` partitions) and the effects table."""
    effects = build_effects(prefix, prefix)
    [event_type] = effects.get("apply").event_types
    topic = event_type.topic
    admin = bench.admin()  # kept alive until the topic exists
    admin.create_topics([NewTopic(topic, num_partitions=bench.partitions)])[topic].result(30)
    create_effects_table(bench.engine)
    return effects, topic


def _truncate(bench: Bench) -> None:
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_receipts, bench_effects"))


def _check_rows(bench: Bench, count: int, side: str) -> None:
    """Raise unless the turn left exactly ``count`` receipts and ``count`` effect rows (a side
    that wrote nothing, or twice, would measure the wrong thing)."""
    with bench.engine.connect() as conn:
        receipts, rows = conn.execute(
            sa.text("SELECT (SELECT count(*) FROM oncely_receipts), count(*) FROM bench_effects")
        ).one()
    if (receipts, rows) != (count, count):
        raise RuntimeError(
            f"{side}: {receipts} receipts and {rows} effect rows after {count} records"
        )


def _joined_consumer(
    bench: Bench, effects: Effects, name: str, stop: threading.Event, settings: ConsumerSettings
) -> tuple[EffectConsumer, threading.Thread]:
    """Effect ``name``'s consumer on a thread, returned once it has joined its group."""
    [consumer] = build_consumers(
        effects=effects,
        names=[name],
        engine=bench.engine,
        kafka=KafkaSettings(bootstrap_servers=bench.bootstrap),
        settings=settings,
        metrics=ConsumerMetrics(),
    )
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    while not consumer.membership.joined_once:
        time.sleep(0.01)
    return consumer, thread


def _oncely(
    bench: Bench,
    effects: Effects,
    count: int,
    *,
    name: str = "apply",
    counter: str = "oncely_consumer_applied_total",
    settings: ConsumerSettings | None = None,
    fresh: bool = True,
) -> float:
    """Records/s of effect ``name``'s consumer in a fresh group, from its join until
    ``counter`` reaches ``count``; with ``fresh``, receipts and effect rows are emptied first."""
    if fresh:
        _truncate(bench)
    effects.group_prefix = f"r3-{uuid.uuid4().hex[:8]}."
    stop = threading.Event()
    consumer, thread = _joined_consumer(
        bench, effects, name, stop, settings or ConsumerSettings(poll_timeout_seconds=0.1)
    )
    sample = consumer.metrics.registry.get_sample_value
    try:
        with cpu_window():
            started = time.perf_counter()
            deadline = time.monotonic() + 600
            while (sample(counter, {"effect": name}) or 0) < count:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise TimeoutError(
                        f"effect {name}: {sample(counter, {'effect': name})} of {count} records"
                    )
                time.sleep(0.01)
            elapsed = time.perf_counter() - started
    finally:
        stop.set()
        thread.join(60)
    _check_rows(bench, count, f"effect {name}")
    return count / elapsed


def _replay(bench: Bench, effects: Effects, count: int) -> float:
    """Records/s of a fresh group on the same effect with every receipt already there."""
    with bench.engine.connect() as conn:
        receipts = conn.execute(
            sa.text("SELECT count(*) FROM oncely_receipts WHERE effect = 'apply'")
        ).scalar_one()
    if receipts != count:  # the first application must have just run
        raise RuntimeError(f"the replay needs {count} receipts of 'apply', found {receipts}")
    return _oncely(
        bench, effects, count, counter="oncely_consumer_duplicates_suppressed_total", fresh=False
    )


PerBatch = Callable[[list[Message]], None]


def _raw(bench: Bench, topic: str, count: int, *, per_batch: PerBatch | None) -> float:
    """Records/s of a raw consumer in a fresh group from its assignment to the ``count``-th
    record; with ``per_batch``, it runs on each batch, then the batch's offsets are stored and
    committed (asynchronously, as the consumer does)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bench.bootstrap,
            "group.id": f"raw-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
    )
    joined = threading.Event()
    consumer.subscribe([topic], on_assign=lambda c, p: joined.set())
    batch_size = ConsumerSettings().batch_size
    seen = 0
    started = None
    with contextlib.ExitStack() as window:
        while seen < count:
            messages = [m for m in consumer.consume(batch_size, 0.1) if m.error() is None]
            if started is None and joined.is_set():
                window.enter_context(cpu_window())
                started = time.perf_counter()
            seen += len(messages)
            if messages and per_batch is not None:
                per_batch(messages)
                last: dict[tuple[str, int], int] = {}
                for m in messages:
                    last[(m.topic() or "", m.partition() or 0)] = m.offset() or 0
                consumer.store_offsets(
                    offsets=[TopicPartition(t, p, o + 1) for (t, p), o in last.items()]
                )
                consumer.commit(asynchronous=True)
        elapsed = time.perf_counter() - (started or time.perf_counter())
    consumer.close()
    return count / elapsed


def _same_rows(bench: Bench, effects: Effects) -> tuple[PerBatch, Callable[[], None]]:
    """What R3-fair's raw side does per batch (see the module), and how to close it."""
    [event_type] = effects.get("apply").event_types
    schema = parse_schema(event_type.schema)
    conn = psycopg.connect(libpq_dsn(bench.database_url))

    def write(messages: list[Message]) -> None:
        ids, topics, partitions, offsets, amounts = [], [], [], [], []
        for m in messages:
            event_id = dict(m.headers() or [])["id"]
            # The oncely single-object frame: 2 marker bytes and an 8-byte fingerprint.
            datum = schemaless_reader(io.BytesIO((m.value() or b"")[10:]), schema, None)
            ids.append(event_id.decode() if isinstance(event_id, bytes) else str(event_id))
            topics.append(m.topic())
            partitions.append(m.partition())
            offsets.append(m.offset())
            amounts.append(datum["amount"])  # type: ignore[call-overload,index]
        with conn.pipeline(), conn.transaction():
            conn.execute(_RECEIPTS, ("apply", ids, topics, partitions, offsets))
            conn.execute(_EFFECTS, (ids, amounts))

    return write, conn.close


def _fair(bench: Bench, effects: Effects, topic: str, count: int) -> float:
    _truncate(bench)
    write, close = _same_rows(bench, effects)
    try:
        rate = _raw(bench, topic, count, per_batch=write)
    finally:
        close()
    _check_rows(bench, count, "the raw consumer writing the same rows")
    return rate


def throughput_cells(bench: Bench, *, repetitions: int, count: int, cells: list[str]) -> list[Cell]:
    """The requested cells among R3, R3-fair and R3-dup, measured in one interleaved run."""
    effects, topic = _new_app(bench, f"r3-{uuid.uuid4().hex[:6]}.")
    produce(bench, effects, count)

    def empty_transaction(_: list[Message]) -> None:
        with bench.engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))

    available: dict[str, Callable[[], float]] = {
        OURS: lambda: _oncely(bench, effects, count),
        REPLAY: lambda: _replay(bench, effects, count),  # right after OURS: its receipts
        FAIR: lambda: _fair(bench, effects, topic, count),
        EMPTY: lambda: _raw(bench, topic, count, per_batch=empty_transaction),
        COUNTING: lambda: _raw(bench, topic, count, per_batch=None),
    }
    wanted = [OURS] + [side for cell in cells for side in NEEDS[cell]]
    try:
        run = interleave(
            {side: run for side, run in available.items() if side in wanted},
            repetitions=repetitions,
        )
    finally:
        delete_topic(bench, topic)
    batch = ConsumerSettings().batch_size
    note = (
        f"{count} records (Avro, 200 B-class) over {bench.keys} keys, {bench.partitions} "
        f"partitions, batch {batch}; consumer on a thread of the bench process; handler "
        "ctx.insert(BenchEffect, {...}) (one bench_effects row per event, no index)"
    )
    made = {
        "R3": Cell(
            "R3",
            OURS,
            [EMPTY, COUNTING],
            "records/s",
            target=">= 0.3",
            measures="consumer with receipts / a raw consumer opening and committing one empty "
            "transaction per batch",
            notes=[note],
        ),
        "R3-fair": Cell(
            "R3-fair",
            OURS,
            [FAIR],
            "records/s",
            target=">= 0.9",
            measures="consumer with receipts / a raw consumer writing the same receipt and "
            "effect rows per batch with plain psycopg (same rows, same transactions)",
            notes=[
                note,
                "raw side: fastavro decode per record; per batch one transaction in psycopg "
                "pipeline mode (one round trip): one unnest INSERT into oncely_receipts "
                "(ON CONFLICT DO NOTHING, no RETURNING) and one into bench_effects, COMMIT; "
                "then store and commit the offsets (asynchronously)",
            ],
        ),
        "R3-dup": Cell(
            "R3-dup",
            REPLAY,
            [OURS],
            "records/s",
            target=">= 3",
            measures="a fresh group replaying records already applied (receipts kept, every "
            "record a duplicate) / the first application",
            notes=[note],
        ),
    }
    result = []
    for name in cells:
        cell = made[name]
        cell.take(run)
        result.append(cell)
    return result


def lanes_cell(bench: Bench, *, repetitions: int, count: int) -> Cell:
    """R-LANES: a handler that waits 2 ms per record, 8 lanes / 1 lane."""
    effects, topic = _new_app(bench, f"rl-{uuid.uuid4().hex[:6]}.")
    produce(bench, effects, count)
    cell = Cell(
        "R-LANES",
        LANES_8,
        [LANES_1],
        "records/s",
        target=">= 6",
        measures="a handler that waits 2 ms per record (time.sleep, then its ctx.insert row): "
        "ONCELY_CONSUMER_LANES=8 / 1",
        notes=[
            f"{count} records over {bench.keys} keys, {bench.partitions} partitions, batch "
            f"{ConsumerSettings().batch_size}; consumer on a thread of the bench process, a fresh "
            "group and no receipts per turn; 1 lane cannot exceed 500 records/s"
        ],
    )
    sides: dict[str, Callable[[], float]] = {
        side: functools.partial(
            _oncely,
            bench,
            effects,
            count,
            name="wait",
            settings=ConsumerSettings(poll_timeout_seconds=0.1, lanes=lanes),
        )
        for side, lanes in ((LANES_8, 8), (LANES_1, 1))
    }
    try:
        cell.measure(sides, repetitions=repetitions)
    finally:
        delete_topic(bench, topic)
    return cell


def at_shares(
    samples: list[tuple[float, float]], total: float, shares: tuple[float, ...]
) -> dict[str, float | None]:
    """For each share, the value of the first ``(done, value)`` sample with ``done`` at or past
    ``share * total`` (``None`` when no sample reached it); ``samples`` in time order."""
    result: dict[str, float | None] = {}
    for share in shares:
        reached = [value for done, value in samples if done >= share * total]
        result[f"{share:.0%}"] = reached[0] if reached else None
    return result


def rss_cell(bench: Bench, *, records: int) -> dict[str, Any]:
    """R-RSS: the resident set size of one ``oncely consume`` process applying a backlog of
    ``records`` records (produced first, a fresh group), sampled every 0.1 s."""
    prefix = f"rss-{uuid.uuid4().hex[:6]}."
    effects, topic = _new_app(bench, prefix)
    _truncate(bench)
    started = time.perf_counter()
    produce(bench, effects, records)
    produced_in = time.perf_counter() - started
    env = {
        "ONCELY_DATABASE_URL": bench.database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bench.bootstrap,
        "ONCELY_BENCH_TOPIC_PREFIX": prefix,
        "ONCELY_BENCH_GROUP_PREFIX": prefix,
    }
    argv = ["consume", "bench.effects_app:effects", "--effect", "apply"]
    samples: list[tuple[float, float]] = []
    with processes(argv, 1, env) as [consumer]:
        pid = consumer.proc.pid
        wait_ready([consumer])
        ready_rss, _ = memory_mb(pid)
        started = time.perf_counter()
        deadline = time.monotonic() + 3600
        applied = 0.0
        last_scrape = 0.0
        while applied < records:
            if consumer.proc.poll() is not None:
                raise RuntimeError(f"the consumer exited with {consumer.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the consumer applied {applied:.0f} of {records} records")
            rss, peak = memory_mb(pid)
            if time.monotonic() - last_scrape >= 0.25:
                applied = metric(consumer, "oncely_consumer_applied_total", effect="apply")
                last_scrape = time.monotonic()
            samples.append((applied, rss))
            time.sleep(0.1)
        elapsed = time.perf_counter() - started
        rss, peak = memory_mb(pid)
    delete_topic(bench, topic)
    _truncate(bench)
    shares = at_shares(samples, records, RSS_POINTS)
    known = [v for v in shares.values() if v is not None]
    growth = (known[-1] - known[0]) / known[0] if len(known) >= 2 else None
    points = ", ".join(f"{share} {value} MiB" for share, value in shares.items())
    return {
        "cell": "R-RSS",
        "kind": "memory",
        "measures": f"peak RSS of one `oncely consume` process applying a {records:,}-record "
        "backlog (a replay: produced first, then a fresh group)",
        "records": records,
        "rate_per_second": round(records / elapsed, 1),
        "rss_mib": {"ready": ready_rss, **shares, "end": rss, "peak": peak},
        "growth_10_to_90": None if growth is None else round(growth, 3),
        "samples": [list(s) for s in samples[:: max(1, len(samples) // 200)]],
        "notes": [
            f"{records} records over {bench.keys} keys, {bench.partitions} partitions, produced "
            f"in {produced_in:.0f} s before the consumer started; consumer defaults (batch "
            f"{ConsumerSettings().batch_size}); RSS (VmRSS) sampled every 0.1 s, progress from "
            f"its /metrics every 0.25 s; RSS when ready {ready_rss} MiB, at {points}, at the "
            f"end {rss} MiB; peak (VmHWM) {peak} MiB",
        ],
    }
