"""R3 (consumer with receipts vs raw consumers) and R4 (commit → effect latency)."""

from __future__ import annotations

import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import NewTopic
from pydantic import BaseModel
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from bench.fixtures import Bench, outbox_writers, percentiles, relays, restage
from bench.harness import Cell, alternate, open_loop
from oncely.consumers.effects import EffectContext, Effects
from oncely.consumers.runner import EffectConsumer
from oncely.consumers.service import build_consumers
from oncely.events import Registry
from oncely.ops.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.settings import ConsumerSettings, KafkaSettings

WRITERS = 2
PIPELINE_DRAIN_EVENTS = 10_000
WARMUP_SECONDS = 1.0


class Credited(BaseModel):
    account: str
    amount: int


class _Base(DeclarativeBase):
    pass


class BenchEffect(_Base):
    """The effect's row (the table has no key: the mapper's key is the event id)."""

    __tablename__ = "bench_effects"
    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    amount: Mapped[int]


def _app(prefix: str) -> tuple[Effects, str]:
    registry = Registry(topic_prefix=prefix)
    model = type("Credited", (Credited,), {"__module__": __name__})
    registry.register(model, name="credited", key="account", aggregate="account")
    effects = Effects(registry, group_prefix=f"{prefix}{uuid.uuid4().hex[:6]}.")

    def apply(event: Credited, ctx: EffectContext) -> None:
        ctx.session.add(BenchEffect(event_id=ctx.event_id, amount=event.amount))

    effects.effect("apply", on=[model])(apply)
    return effects, registry.for_model(model).topic


def _create_effects_table(bench: Bench) -> None:
    with bench.engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS bench_effects (event_id uuid, amount int)")
        )


def _produce(bench: Bench, effects: Effects, topic: str, count: int) -> None:
    codec = Codec(registry=effects.registry)
    model = effects.get("apply").event_types[0].model
    producer = Producer({"bootstrap.servers": bench.bootstrap, "linger.ms": 20})
    for i in range(count):
        value, headers = codec.encode(model(account=f"acc-{i % bench.keys}", amount=i))
        while True:
            try:
                producer.produce(
                    topic,
                    key=f"acc-{i % bench.keys}".encode(),
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
    producer.flush(60)


def _joined_consumer(
    bench: Bench, effects: Effects, stop: threading.Event, *, poll_timeout: float
) -> tuple[EffectConsumer, threading.Thread]:
    """The ``apply`` effect's consumer on a thread, returned once it has joined its group."""
    [consumer] = build_consumers(
        effects=effects,
        names=["apply"],
        engine=bench.engine,
        kafka=KafkaSettings(bootstrap_servers=bench.bootstrap),
        settings=ConsumerSettings(batch_size=bench.batch_size, poll_timeout_seconds=poll_timeout),
        metrics=ConsumerMetrics(),
    )
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    while not consumer.membership.joined_once:
        time.sleep(0.01)
    return consumer, thread


def _with_receipts(bench: Bench, effects: Effects, count: int) -> float:
    # Every repetition applies every record again: a fresh group and no receipts left.
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_receipts, bench_effects"))
    effects.group_prefix = f"r3-{uuid.uuid4().hex[:8]}."
    stop = threading.Event()
    consumer, thread = _joined_consumer(bench, effects, stop, poll_timeout=0.1)
    started = time.perf_counter()
    sample = consumer.metrics.registry.get_sample_value
    while (sample("oncely_consumer_applied_total", {"effect": "apply"}) or 0) < count:
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    stop.set()
    thread.join(60)
    return count / elapsed


def _raw(
    bench: Bench, topic: str, count: int, *, per_batch: Callable[[Consumer], None] | None
) -> float:
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
    seen = 0
    started = None
    while seen < count:
        messages = consumer.consume(bench.batch_size, 0.1)
        if started is None and joined.is_set():
            started = time.perf_counter()
        seen += sum(1 for m in messages if m.error() is None)
        if messages and per_batch is not None:
            per_batch(consumer)
            consumer.store_offsets(messages[-1])
            consumer.commit(asynchronous=True)
    elapsed = time.perf_counter() - (started or time.perf_counter())
    consumer.close()
    return count / elapsed


def consumer_cell(bench: Bench, *, repetitions: int, count: int) -> Cell:
    """R3: applying with receipts vs counting, and vs an empty transaction per batch."""
    _create_effects_table(bench)
    effects, topic = _app(f"r3-{uuid.uuid4().hex[:6]}.")
    admin = bench.admin()
    admin.create_topics([NewTopic(topic, num_partitions=bench.partitions)])[topic].result(30)
    _produce(bench, effects, topic, count)

    def empty_transaction(_: Consumer) -> None:
        with bench.engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))

    cell = Cell(
        "R3",
        "consumer with receipts (one row per effect)",
        ["raw consumer, counting", "raw consumer + empty transaction and commit per batch"],
        "records/s",
        target="(ii) >= 0.8",
        notes=[
            f"{count} records, batch {bench.batch_size}, {bench.partitions} partitions",
            "handler: ctx.session.add(row), the documented idiom (flushed together)",
        ],
    )
    cell.rates = alternate(
        {
            cell.numerator: lambda: _with_receipts(bench, effects, count),
            cell.denominators[0]: lambda: _raw(bench, topic, count, per_batch=None),
            cell.denominators[1]: lambda: _raw(bench, topic, count, per_batch=empty_transaction),
        },
        repetitions=repetitions,
        warmup=False,
    )
    return cell


def _since(due: list[float], ends: dict[int, float], starts: dict[int, float]) -> list[float]:
    """Milliseconds from ``starts[i]`` to ``ends[i]`` for events due after the first second."""
    warm = due[0] + WARMUP_SECONDS
    return [(ends[i] - starts[i]) * 1000 for i in ends if i in starts and due[i] >= warm]


def _pipeline(bench: Bench, total: int) -> tuple[Effects, list[dict[str, Any]]]:
    """An effects app on a fresh topic, and ``total`` outbox rows of its event to stage."""
    effects, topic = _app(f"r4-{uuid.uuid4().hex[:6]}.")
    admin = bench.admin()
    admin.create_topics([NewTopic(topic, num_partitions=bench.partitions)])[topic].result(30)
    codec = Codec(registry=effects.registry)
    model = effects.get("apply").event_types[0].model
    rows = [
        {
            "id": uuid.uuid4(),
            "aggregatetype": "account",
            "aggregateid": f"acc-{i % bench.keys}",
            "type": "credited",
            "topic": topic,
            "payload": value,
            "headers": headers,
            "event_key": uuid.uuid4().hex,
        }
        for i, (value, headers) in enumerate(
            codec.encode(model(account=f"acc-{i % bench.keys}", amount=i)) for i in range(total)
        )
    ]
    _create_effects_table(bench)
    return effects, rows


def _wait_applied(consumer: EffectConsumer, total: int, *, timeout: float) -> None:
    sample = consumer.metrics.registry.get_sample_value
    deadline = time.monotonic() + timeout
    while (sample("oncely_consumer_applied_total", {"effect": "apply"}) or 0) < total:
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _pipeline_drain(bench: Bench, total: int) -> float:
    """Events/s from staged to applied, all staged at once, through the same relay + consumer."""
    effects, rows = _pipeline(bench, total)
    restage(bench, rows)
    stop = threading.Event()
    consumer, thread = _joined_consumer(bench, effects, stop, poll_timeout=0.05)
    started = time.perf_counter()
    with relays(bench, 1):
        _wait_applied(consumer, total, timeout=600)
    elapsed = time.perf_counter() - started
    stop.set()
    thread.join(60)
    return total / elapsed


def _pipeline_latency(bench: Bench, rate: float, seconds: float) -> dict[str, dict[str, float]]:
    total = int(rate * seconds)
    effects, rows = _pipeline(bench, total)
    topic = str(rows[0]["topic"])
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_outbox"))
    stop = threading.Event()
    consumer, thread = _joined_consumer(bench, effects, stop, poll_timeout=0.05)
    with relays(bench, 1), outbox_writers(bench, rows, count=WRITERS) as writes:
        open_loop(rate, seconds, writes.writers)
        _wait_applied(consumer, total, timeout=120)
    stop.set()
    thread.join(60)
    index = {row["id"]: i for i, row in enumerate(rows)}
    applied: dict[int, float] = {}
    with bench.engine.connect() as conn:
        for event_id, done in conn.execute(
            sa.text(
                "SELECT o.id, EXTRACT(EPOCH FROM r.applied_at)"
                " FROM oncely_outbox o JOIN oncely_receipts r ON r.event_id = o.id"
                " WHERE o.topic = :t"
            ),
            {"t": topic},
        ):
            applied[index[event_id]] = float(done)
    due, committed, scheduled = (
        writes.due,
        dict(enumerate(writes.committed)),
        dict(enumerate(writes.due)),
    )
    return {
        "commit_to_effect": percentiles(_since(due, applied, committed)),
        "schedule_to_effect": percentiles(_since(due, applied, scheduled)),
        "writer_lag": percentiles(_since(due, committed, scheduled)),
    }


def _raw_latency(bench: Bench, rate: float, seconds: float) -> dict[str, dict[str, float]]:
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
        while len(received) < total and not done.is_set():
            for message in consumer.consume(500, 0.05):
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

    def produce(i: int, due_at: float) -> None:
        due[i] = due_at
        with lock:
            key = f"acc-{i % bench.keys}".encode()
            producer.produce(topic, key=key, value=struct.pack("q", i) + padding)
            producer.poll(0)

    open_loop(rate, seconds, [produce] * WRITERS)
    producer.flush(30)
    reader.join(60)
    done.set()
    consumer.close()
    return {
        "produce_to_consume": percentiles(_since(due, received, produced)),
        "schedule_to_consume": percentiles(_since(due, received, dict(enumerate(due)))),
    }


def latency_cell(bench: Bench, *, seconds: float) -> dict[str, object]:
    """R4: commit → effect latency at 25/50/80% of the pipeline's drain rate, and raw Kafka's.

    The drain rate is measured first on the same pipeline (relay and effect consumer on threads
    of this process, as the latency runs use them): rows staged at once, time to all applied.
    """
    drain_rate = _pipeline_drain(bench, PIPELINE_DRAIN_EVENTS)
    levels = []
    for load in (0.25, 0.5, 0.8):
        rate = max(10.0, drain_rate * load)
        levels.append(
            {
                "load": load,
                "rate_per_second": round(rate),
                "pipeline_ms": _pipeline_latency(bench, rate, seconds),
                "raw_kafka_ms": _raw_latency(bench, rate, seconds),
            }
        )
    return {
        "cell": "R4",
        "unit": "ms",
        "pipeline_drain_rate": round(drain_rate, 1),
        "levels": levels,
        "target": "pipeline p99 < 25 ms at 50% load",
        "notes": [
            f"open loop (event i due at t0 + i/rate), {seconds:.0f} s per level, events due in "
            f"the first {WARMUP_SECONDS:.0f} s excluded; one transaction per event from "
            f"{WRITERS} writer threads (own connection, prepared INSERT). commit→effect: the "
            "writer's clock after its commit to receipt applied_at (one host, one clock); "
            "schedule→effect adds the writers' lag, so a writer that "
            "fell behind shows (no coordinated omission). Raw Kafka: the same rate and keys, "
            "200 B values, produce (record timestamp) and schedule to consume."
        ],
    }
