"""Debezium parity: the same outbox rows relayed by oncely's relay and by Debezium's EventRouter.

One database holds the rows; their ``topic`` column names topic set A (``<run>.A.<type>``), which
oncely's relay publishes to as is. The Debezium connector routes the same rows into topic set B
with ``route.topic.regex=\\Q<run>.A.\\E(?<routedByValue>.*)`` and the prefix ``<run>.B.``. So
both relays read the very same rows (same ids, payloads, keys, order) and only the topic name
differs, which keeps the comparison record for record.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel

from oncely.consumers.effects import EffectContext, Effects
from oncely.consumers.runner import EffectConsumer
from oncely.consumers.service import build_consumers
from oncely.debezium import (
    ConnectorOptions,
    SlotBehindError,
    connector_config,
    drop_slot,
    purge_marked,
    purge_plan,
    slot_status,
    wait_for_slot,
)
from oncely.devstack.connect import ConnectNode
from oncely.events import Encoding, Registry
from oncely.producer.staging import stage_many
from oncely.runtime.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.schemas.loader import schema_registry_client
from oncely.settings import ConsumerSettings, KafkaSettings, SchemaSettings
from oncely.wire import CLOUDEVENTS_HEADERS as CLOUDEVENTS
from tests.helpers import (
    Record,
    count_published,
    fast_settings,
    read_topics,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.debezium]

PARTITIONS = 6
EVENTS = 1000
KEYS = 7
CLOUDEVENTS_SOURCE = "/oncely/parity"


class Opened(BaseModel):
    account_id: str
    n: int


class Credited(BaseModel):
    account_id: str
    amount: int
    n: int


class Noted(BaseModel):
    account_id: str
    note: str
    n: int


#: One event type per encoding.
TYPES: list[tuple[type[BaseModel], str, Encoding]] = [
    (Opened, "parity.opened", "avro"),
    (Credited, "parity.credited", "avro-confluent"),
    (Noted, "parity.noted", "json"),
]


def _registry(topic_prefix: str) -> Registry:
    registry = Registry(topic_prefix=topic_prefix)
    for model, name, encoding in TYPES:
        registry.register(
            model, name=name, key="account_id", aggregate="account", encoding=encoding
        )
    return registry


def _event(i: int) -> BaseModel:
    account = f"compte-{i % KEYS}-\u00e9"  # UTF-8 keys hash the same in Java and librdkafka
    kind = i % len(TYPES)
    if kind == 0:
        return Opened(account_id=account, n=i)
    if kind == 1:
        return Credited(account_id=account, amount=i * 10, n=i)
    return Noted(account_id=account, note=f"note {i} \u00e9\u00e8", n=i)


@dataclass
class Run:
    """Topic sets A (oncely's relay) and B (Debezium) of one test, and its codecs."""

    prefix: str
    registry_a: Registry
    registry_b: Registry
    schema_registry: SchemaRegistryClient

    def codec(self, registry: Registry) -> Codec:
        # Registration on first use: the comparison is about the relays, not the deploy step.
        return Codec(registry=registry, schema_registry=self.schema_registry, auto_register=True)


@pytest.fixture
def run(kafka_admin: AdminClient, schema_registry_url: str) -> Iterator[Run]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    run = Run(
        prefix=prefix,
        registry_a=_registry(f"{prefix}.A."),
        registry_b=_registry(f"{prefix}.B."),
        schema_registry=schema_registry_client(
            SchemaSettings(schema_registry_url=schema_registry_url)
        ),
    )
    topics = run.registry_a.topics() + run.registry_b.topics()
    futures = kafka_admin.create_topics([NewTopic(t, num_partitions=PARTITIONS) for t in topics])
    for future in futures.values():
        future.result(30)
    yield run
    existing = kafka_admin.list_topics(timeout=10).topics
    doomed = [name for name in existing if name.startswith(prefix)]
    for future in kafka_admin.delete_topics(doomed).values():
        future.result(30)


@pytest.fixture(scope="module")
def connect_node(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConnectNode]:
    """One Kafka Connect worker (Debezium installed) for the module's tests."""
    node = ConnectNode(
        data_dir=tmp_path_factory.mktemp("connect"), bootstrap_servers=kafka_bootstrap
    )
    node.start()
    yield node
    node.stop()


@pytest.fixture
def debezium(
    connect_node: ConnectNode, engine: sa.Engine, database_url: str
) -> Iterator[Callable[..., ConnectorOptions]]:
    """``debezium(**options)`` runs a connector on this test's database until the test ends.

    Each connector gets its own name, logical name (Debezium's JMX names must not clash in one
    worker), slot and publication; afterwards it is deleted and its slot dropped (an idle slot
    retains WAL, and the database could not be dropped while it exists).
    """
    started: list[ConnectorOptions] = []

    def start(**overrides: Any) -> ConnectorOptions:
        tag = uuid.uuid4().hex[:10]
        options = ConnectorOptions.from_database_url(
            database_url,
            name=f"parity-{tag}",
            logical_name=f"parity_{tag}",
            slot_name=f"parity_{tag}",
            publication_name=f"parity_{tag}",
            **overrides,
        )
        started.append(options)
        connect_node.add_connector(options.name, connector_config(options))
        return options

    yield start
    for options in started:
        connect_node.remove_connector(options.name)
        assert drop_slot(engine, options.slot_name, timeout=30)
        assert slot_status(engine, options.slot_name) is None


def _topic_total(bootstrap: str, topics: Sequence[str]) -> int:
    """How many records ``topics`` hold (high minus low watermarks)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        total = 0
        for topic in topics:
            for partition in range(PARTITIONS):
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), 10)
                total += high - low
        return total
    finally:
        consumer.close()


def _stage(
    engine: sa.Engine,
    codec: Codec,
    numbers: range,
    batch: int = 100,
    traces: dict[str, int] | None = None,
) -> list[uuid.UUID]:
    """Stage events ``numbers`` in transactions of ``batch``; return their ids in order. With
    ``traces``, every other transaction runs inside a span: its events' trace ids go there."""
    ids: list[uuid.UUID] = []
    tracer = TracerProvider().get_tracer("parity")
    for start in range(numbers.start, numbers.stop, batch):
        traced = traces is not None and (start // batch) % 2 == 0
        with contextlib.ExitStack() as stack:
            span = stack.enter_context(tracer.start_as_current_span("stage")) if traced else None
            with engine.begin() as conn:
                staged = stage_many(
                    conn,
                    [_event(i) for i in range(start, min(start + batch, numbers.stop))],
                    codec=codec,
                )
        if traces is not None and span is not None:
            traces.update({str(e.id): span.get_span_context().trace_id for e in staged})
        ids.extend(event.id for event in staged)
    return ids


def _trace_id(record: Record) -> int | None:
    traceparent = record.headers.get("traceparent")
    return int(traceparent.decode().split("-")[1], 16) if traceparent else None


def _by_id(records: Sequence[Record]) -> dict[str, Record]:
    result = {record.headers["id"].decode(): record for record in records}
    assert len(result) == len(records), "an event id was published twice"
    return result


def _order_per_key(
    records: Sequence[Record], topic_of: Callable[[str], str]
) -> dict[tuple[str, str], list[str]]:
    """Event ids per (event type topic, key), in partition offset order."""
    ordered: dict[tuple[str, str], list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        ordered[(topic_of(record.topic), record.key)].append(record.headers["id"].decode())
    return dict(ordered)


APPLIED = """
CREATE TABLE parity_applied (event_id uuid NOT NULL, type text NOT NULL, account_id text, n int)
"""


def _apply(event: Any, ctx: EffectContext) -> None:
    ctx.session.execute(
        sa.text("INSERT INTO parity_applied VALUES (:e, :t, :a, :n)"),
        {"e": ctx.event_id, "t": type(event).__name__, "a": event.account_id, "n": event.n},
    )


@contextlib.contextmanager
def _consumers(
    effects: Effects, engine: sa.Engine, bootstrap: str, codec: Codec
) -> Iterator[EffectConsumer]:
    """The ``apply`` effect's consumer on a thread for the block (offsets committed after)."""
    stop = threading.Event()
    [consumer] = build_consumers(
        effects=effects,
        names=["apply"],
        engine=engine,
        kafka=KafkaSettings(bootstrap_servers=bootstrap),
        settings=ConsumerSettings(batch_size=200, poll_timeout_seconds=0.2),
        metrics=ConsumerMetrics(),
        codec=codec,
    )
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the consumer did not stop within 60 s"


def _duplicates(consumer: EffectConsumer) -> float:
    sample = consumer.metrics.registry.get_sample_value(
        "oncely_consumer_duplicates_suppressed_total", {"effect": "apply"}
    )
    return sample or 0.0


def _consume_b_twice(run: Run, engine: sa.Engine, bootstrap: str, ids: list[uuid.UUID]) -> None:
    """A consumer group applies topic set B once; B delivered again is absorbed by receipts."""
    with engine.begin() as conn:
        conn.exec_driver_sql(APPLIED)
    effects = Effects(run.registry_b, group_prefix=f"{run.prefix}.")
    effects.effect("apply", on=[model for model, _, _ in TYPES])(_apply)
    codec = run.codec(run.registry_b)
    receipts = "SELECT count(*) FROM oncely_receipts WHERE effect = 'apply'"
    with _consumers(effects, engine, bootstrap, codec):
        wait_until(lambda: scalar(engine, receipts) == EVENTS, timeout=60)
    # Redelivery: the group starts over from the beginning of every B partition.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    rewind = [TopicPartition(t, p, 0) for t in run.registry_b.topics() for p in range(PARTITIONS)]
    group = effects.group_id("apply")
    for future in admin.alter_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, rewind)]
    ).values():
        future.result(30)
    with _consumers(effects, engine, bootstrap, codec) as consumer:
        wait_until(lambda: _duplicates(consumer) == EVENTS, timeout=60)
    assert scalar(engine, receipts) == EVENTS
    with engine.connect() as conn:
        applied = conn.execute(sa.text("SELECT event_id FROM parity_applied")).scalars().all()
    assert sorted(applied) == sorted(ids)


@pytest.mark.timeout(600)  # the first run resolves Kafka Connect and Debezium with Maven
def test_debezium_and_the_relay_publish_the_same_records(
    run: Run, engine: sa.Engine, kafka_bootstrap: str, debezium: Callable[..., ConnectorOptions]
) -> None:
    codec = run.codec(run.registry_a)
    topics_a, topics_b = run.registry_a.topics(), run.registry_b.topics()
    half = EVENTS // 2
    traces: dict[str, int] = {}
    # Rows committed before the connector starts reach B through its snapshot ...
    ids = _stage(engine, codec, range(half), traces=traces)
    options = debezium(
        route_regex=rf"\Q{run.prefix}.A.\E(?<routedByValue>.*)",
        topic_prefix=f"{run.prefix}.B.",
        cloudevents_source=CLOUDEVENTS_SOURCE,
    )
    wait_until(lambda: _topic_total(kafka_bootstrap, topics_b) == half, timeout=60)
    # skipped.operations=u,d,t: UPDATEs and DELETEs do not even leave PostgreSQL.
    publication = "SELECT pubinsert, pubupdate, pubdelete FROM pg_publication WHERE pubname = :p"
    with engine.connect() as conn:
        publishes = conn.execute(sa.text(publication), {"p": options.publication_name}).one()
    assert tuple(publishes) == (True, False, False)
    # ... and rows committed afterwards through the WAL stream.
    ids += _stage(engine, codec, range(half, EVENTS), traces=traces)
    settings = fast_settings(cloudevents_source=CLOUDEVENTS_SOURCE)
    with running_relay(engine, kafka_bootstrap, settings):
        wait_until(lambda: _topic_total(kafka_bootstrap, topics_a) == EVENTS, timeout=60)
        wait_until(lambda: count_published(engine) == EVENTS, timeout=30)
    wait_until(lambda: _topic_total(kafka_bootstrap, topics_b) == EVENTS, timeout=60)

    records_a, records_b = (
        read_topics(kafka_bootstrap, topics_a),
        read_topics(kafka_bootstrap, topics_b),
    )
    by_id_a, by_id_b = _by_id(records_a), _by_id(records_b)
    assert set(by_id_a) == set(by_id_b) == {str(i) for i in ids}
    for event_id, a in by_id_a.items():
        b = by_id_b[event_id]
        assert b.topic == a.topic.replace(f"{run.prefix}.A.", f"{run.prefix}.B.", 1)
        assert b.key == a.key
        assert b.value == a.value
        assert b.partition == a.partition
        assert b.headers["eventType"] == a.headers["eventType"]
        # Debezium sends the two CloudEvents constants first (moved from its change event), the
        # traceparent of its tracing SMT, then what the router places (extended headers off);
        # the relay adds the row's own headers after eventType.
        traced = event_id in traces
        assert b.header_names == (
            ("ce_source", "ce_specversion")
            + ("traceparent",) * traced
            + ("id", "eventType", "ce_id", "ce_type", "ce_time")
        )
        assert a.header_names[:2] == ("id", "eventType")
        assert a.header_names.count("traceparent") == traced
        for name in CLOUDEVENTS:
            assert b.headers[name] == a.headers[name], name
        # One trace from the staging span, through either relay (Debezium's tracing SMT
        # parents a span of its own on the staged context).
        assert _trace_id(a) == _trace_id(b) == traces.get(event_id)
    assert {a.headers["ce_source"] for a in records_a} == {CLOUDEVENTS_SOURCE.encode()}
    assert 0 < len(traces) < EVENTS
    assert {a.headers["content-type"] for a in records_a} == {
        b"application/vnd.oncely.avro",
        b"application/vnd.confluent.avro",
        b"application/json",
    }
    assert len({(a.topic, a.partition) for a in records_a}) > len(TYPES) * 2, "few partitions"
    strip = f"{run.prefix}.A.", f"{run.prefix}.B."
    assert _order_per_key(records_a, lambda t: t.removeprefix(strip[0])) == _order_per_key(
        records_b, lambda t: t.removeprefix(strip[1])
    )

    _consume_b_twice(run, engine, kafka_bootstrap, ids)

    # The relay wrote no outbox row (its progress is in its own tables, not captured); a purge
    # (DELETEs) emits nothing either.
    # The purge deletes the rows before its mark once the connector's slot has confirmed the
    # mark's WAL position: Debezium confirms a position after reading a later change and
    # committing its offsets, so rows keep coming (as traffic would) until it has. The rows
    # staged after the mark stay in the outbox, and each is on B once.
    plan = purge_plan(engine, older_than_seconds=0, slot_name=options.slot_name)
    assert plan.rows == EVENTS
    late: list[uuid.UUID] = []

    def confirmed() -> bool:
        late.extend(_stage(engine, codec, range(EVENTS + len(late), EVENTS + len(late) + 1)))
        try:
            wait_for_slot(engine, options.slot_name, plan.mark, timeout=2)
        except SlotBehindError:
            return False
        return True

    wait_until(confirmed, timeout=120, interval=0.5)
    assert purge_marked(engine, plan.mark, older_than_seconds=0) == EVENTS
    with engine.connect() as conn:
        remaining = conn.execute(sa.text("SELECT id FROM oncely_outbox")).scalars().all()
    assert sorted(remaining) == sorted(late)
    total = EVENTS + len(late)
    wait_until(lambda: _topic_total(kafka_bootstrap, topics_b) == total, timeout=60)
    on_b = [r.headers["id"] for r in read_topics(kafka_bootstrap, topics_b)]
    assert sorted(on_b) == sorted({str(i).encode() for i in [*ids, *late]})
