"""R-CLUSTER: scale-out on a real three-node Kafka cluster (replication factor 3, min ISR 2).

Two ratios, each side run as separate ``oncely`` processes, the way they are deployed:

- **consumer group**: 3 instances of one consumer group vs 1 instance, applying effects with
  receipts from a 6-partition topic (records/s);
- **relay**: 2 relays vs 1, draining outbox rows staged all at once to the cluster (rows/s).

Rates are measured on the database clock between the first and the last effect applied (or
row published). Start-up is left out: records are produced once the group's partitions are
spread evenly and stable, and rows are staged (in one transaction) once every relay is
ready. The machine's cores bound what more processes can add: on 2 cores, three brokers,
PostgreSQL and the processes under test share them.

``cluster_cells()`` starts its own :class:`~oncely.devstack.KafkaCluster` (and a PostgreSQL
unless given a database URL). Not in the default run: ``python -m bench R-CLUSTER``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic
from pydantic import BaseModel

from bench.fixtures import (
    Bench,
    Running,
    Topics,
    drain_rate,
    processes,
    relay_processes,
    staged_rows,
    wait_ready,
)
from bench.harness import Cell, alternate
from oncely.consumers.effects import EffectContext, Effects
from oncely.devstack import KafkaCluster, PostgresNode
from oncely.events import Registry
from oncely.schemas.codec import Codec
from oncely.storage import upgrade

PARTITIONS = 6
CONSUMER_NUMERATOR, CONSUMER_DENOMINATOR = "3 consumer instances", "1 consumer instance"
RELAY_NUMERATOR, RELAY_DENOMINATOR = "2 relays", "1 relay"


class Credited(BaseModel):
    account: str
    amount: int


def build_effects(topic_prefix: str, group_prefix: str) -> Effects:
    """The benchmark's effects app: one effect, ``apply``, inserting one row per event."""
    registry = Registry(topic_prefix=topic_prefix)
    model = type("Credited", (Credited,), {"__module__": __name__})
    registry.register(model, name="credited", key="account", aggregate="account")
    effects = Effects(registry, group_prefix=group_prefix)

    def apply(event: Credited, ctx: EffectContext) -> None:
        ctx.session.execute(
            sa.text("INSERT INTO bench_effects (event_id, amount) VALUES (:e, :a)"),
            {"e": ctx.event_id, "a": event.amount},
        )

    effects.effect("apply", on=[model])(apply)
    return effects


#: What ``oncely consume bench.cluster_cells:effects`` runs (prefixes from the environment).
effects = build_effects(
    os.environ.get("ONCELY_BENCH_TOPIC_PREFIX", "bench-cluster."),
    os.environ.get("ONCELY_BENCH_GROUP_PREFIX", ""),
)


def _owned(log: Path) -> set[str]:
    """The partitions a consumer holds now, replayed from its assign/revoke log records."""
    owned: set[str] = set()
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("message") == "partitions assigned":
            owned |= set(record.get("partitions", []))
        elif record.get("message") == "partitions revoked":
            owned -= set(record.get("partitions", []))
    return owned


def _wait_balanced(running: list[Running], *, settle: float = 2.0, timeout: float = 120) -> None:
    """Wait until the group's partitions are spread evenly and stayed so for ``settle`` s."""
    deadline = time.monotonic() + timeout
    stable_since, last = time.monotonic(), None
    while True:
        owned = [frozenset(_owned(each.log)) for each in running]
        sizes = [len(o) for o in owned]
        balanced = sum(sizes) == PARTITIONS and max(sizes) - min(sizes) <= 1
        if owned != last:
            stable_since, last = time.monotonic(), owned
        elif balanced and time.monotonic() - stable_since >= settle:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the group never settled: {sizes} partitions per instance")
        time.sleep(0.2)


def _rate(bench: Bench, sql: str, expected: int, *, timeout: float = 600, **params: str) -> float:
    """Wait until ``sql`` (count, first, last) counts ``expected``; rows per second between."""
    deadline = time.monotonic() + timeout
    while True:
        with bench.engine.connect() as conn:
            count, first, last = conn.execute(sa.text(sql), params).one()
        if count >= expected:
            return float(count / max((last - first).total_seconds(), 1e-3))
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {count} of {expected} done")
        time.sleep(0.2)


def _produce(bench: Bench, app: Effects, count: int) -> None:
    codec = Codec(registry=app.registry)
    [event_type] = app.get("apply").event_types
    producer = Producer({"bootstrap.servers": bench.bootstrap, "linger.ms": 20, "acks": "all"})
    for i in range(count):
        key = f"acc-{i % bench.keys}"
        value, headers = codec.encode(event_type.model(account=key, amount=i))
        headers_list: list[tuple[str, str | bytes | None]] = [
            ("id", str(uuid.uuid4())),
            ("eventType", "credited"),
            *headers.items(),
        ]
        while True:
            try:
                producer.produce(
                    event_type.topic, key=key.encode(), value=value, headers=headers_list
                )
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)


def _consumer_group(bench: Bench, instances: int, count: int) -> float:
    """Records/s of ``instances`` consumer processes of one group on a fresh 6-partition topic."""
    prefix = f"rc{uuid.uuid4().hex[:8]}."
    app = build_effects(prefix, prefix)
    [event_type] = app.get("apply").event_types
    admin = bench.admin()
    admin.create_topics([NewTopic(event_type.topic, num_partitions=PARTITIONS)])[
        event_type.topic
    ].result(30)
    env = {
        "ONCELY_DATABASE_URL": bench.database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bench.bootstrap,
        "ONCELY_BENCH_TOPIC_PREFIX": prefix,
        "ONCELY_BENCH_GROUP_PREFIX": prefix,
        "ONCELY_CONSUMER_BATCH_SIZE": str(bench.batch_size),
        "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.1",
    }
    argv = ["consume", "bench.cluster_cells:effects", "--effect", "apply"]
    with processes(argv, instances, env) as running:
        wait_ready(running)
        _wait_balanced(running)  # produce only once the last join's rebalance is over
        _produce(bench, app, count)
        rate = _rate(
            bench,
            "SELECT count(*), min(r.applied_at), max(r.applied_at) FROM oncely_receipts r"
            " WHERE r.topic = :topic",
            count,
            topic=event_type.topic,
        )
    admin.delete_topics([event_type.topic])
    return rate


def _relays(bench: Bench, topics: Topics, relays: int, rows: list[dict[str, object]]) -> float:
    """Rows/s of ``relays`` relay processes draining ``rows``, committed once all share the
    shards (from the commit to the last record's append time)."""

    @contextlib.contextmanager
    def side() -> Iterator[None]:
        with relay_processes(bench, relays):
            yield

    return drain_rate(bench, topics, side, rows)


def cluster_cells(
    repetitions: int = 3,
    *,
    database_url: str | None = None,
    rows: int = 20_000,
    records: int = 10_000,
    keys: int = 1000,
    batch_size: int = 500,
) -> list[Cell]:
    """R-CLUSTER cells measured on a fresh three-node cluster: consumer group and relay scaling.

    Starts (and stops) its own :class:`KafkaCluster` and, without ``database_url``, its own
    PostgreSQL; a given database is the benchmark's (oncely's tables are upgraded and the
    outbox is truncated, as the other relay cells do). Returns the consumer cell and the relay
    cell.
    """
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="r-cluster-")))
        if database_url is None:
            postgres = PostgresNode(data_dir=directory / "postgres")
            postgres.start()
            stack.callback(postgres.stop)
            database_url = postgres.url
        cluster = KafkaCluster(data_dir=directory / "kafka", size=3)
        cluster.start()
        stack.callback(cluster.stop)
        engine = sa.create_engine(database_url, pool_size=4)
        stack.callback(engine.dispose)
        upgrade(engine)
        with engine.begin() as conn:
            conn.execute(
                sa.text("CREATE TABLE IF NOT EXISTS bench_effects (event_id uuid, amount int)")
            )
        bench = Bench(
            engine=engine,
            database_url=database_url,
            bootstrap=cluster.bootstrap_servers,
            rows=rows,
            keys=keys,
            batch_size=batch_size,
            partitions=PARTITIONS,
        )
        layout = (
            f"3 combined broker+controller nodes, {PARTITIONS} partitions, replication factor 3, "
            "min.insync.replicas 2, acks=all; separate processes"
        )
        consumer = Cell(
            "R-CLUSTER consumers",
            CONSUMER_NUMERATOR,
            [CONSUMER_DENOMINATOR],
            "records/s",
            target="(context: bounded by cores)",
            notes=[f"{records} records over {keys} keys, batch {batch_size}; {layout}"],
        )
        consumer.rates = alternate(
            {
                CONSUMER_NUMERATOR: lambda: _consumer_group(bench, 3, records),
                CONSUMER_DENOMINATOR: lambda: _consumer_group(bench, 1, records),
            },
            repetitions=repetitions,
            warmup=False,
        )
        topics = Topics(bench)
        stack.callback(topics.close)
        staged = staged_rows(rows, topic="(set per turn)", keys=keys)
        relay = Cell(
            "R-CLUSTER relays",
            RELAY_NUMERATOR,
            [RELAY_DENOMINATOR],
            "rows/s",
            target="(context: bounded by cores)",
            notes=[f"{rows} rows of 200 B over {keys} keys, batch {batch_size}; {layout}"],
        )
        relay.rates = alternate(
            {
                RELAY_NUMERATOR: lambda: _relays(bench, topics, 2, staged),
                RELAY_DENOMINATOR: lambda: _relays(bench, topics, 1, staged),
            },
            repetitions=repetitions,
            warmup=False,
        )
        return [consumer, relay]
