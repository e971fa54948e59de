"""Follow-up events: an effect stages events with ``ctx.stage`` in its receipt's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from oncely.consumers.effects import EffectContext, Effects, FailurePolicy
from oncely.events import Registry
from oncely.runtime.tracing import Tracing
from oncely.schemas.codec import Codec
from oncely.wire import trace_context_fields
from tests.helpers import StatementSpy, running_consumers, scalar, wait_until

pytestmark = pytest.mark.integration


class OrderPlaced(BaseModel):
    order_id: str
    amount: int


class OrderConfirmed(BaseModel):
    order_id: str


@dataclass
class Shop:
    registry: Registry
    effects: Effects
    topic: str


@pytest.fixture
def shop(kafka_admin: AdminClient) -> Iterator[Shop]:
    prefix = f"follow{uuid.uuid4().hex[:10]}."
    registry = Registry(topic_prefix=prefix)
    registry.register(OrderPlaced, name="order.placed", key="order_id", aggregate="order")
    registry.register(OrderConfirmed, name="order.confirmed", key="order_id", aggregate="order")
    topic = registry.for_model(OrderPlaced).topic
    kafka_admin.create_topics([NewTopic(topic, num_partitions=2)])[topic].result(30)
    yield Shop(registry, Effects(registry, group_prefix=prefix), topic)
    for future in kafka_admin.delete_topics([topic]).values():
        future.result(30)


def _traceparent(n: int) -> str:
    return f"00-{n + 1:032x}-{n + 1:016x}-01"


def _publish(bootstrap: str, shop: Shop, orders: list[tuple[str, OrderPlaced]]) -> None:
    """The orders as the relay produces them, each with a trace context of its own."""
    codec = Codec(registry=shop.registry)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for n, (event_id, order) in enumerate(orders):
        value, headers = codec.encode(order)
        producer.produce(
            shop.topic,
            key=order.order_id.encode(),
            value=value,
            headers=[
                ("id", event_id),
                ("eventType", "order.placed"),
                *headers.items(),
                ("traceparent", _traceparent(n)),
            ],
        )
    assert producer.flush(30) == 0


def _follow_ups(engine: sa.Engine) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT event_key, aggregateid, topic, headers, tracingspancontext"
                    " FROM oncely_outbox WHERE type = 'order.confirmed' ORDER BY seq"
                )
            )
        )


def _applied(consumer: Any) -> float:
    sample = consumer.metrics.registry.get_sample_value
    value: float = sample("oncely_consumer_applied_total", {"effect": consumer.effect.name}) or 0.0
    return value


def _duplicates(consumer: Any) -> float:
    sample = consumer.metrics.registry.get_sample_value
    value: float = (
        sample("oncely_consumer_duplicates_suppressed_total", {"effect": consumer.effect.name})
        or 0.0
    )
    return value


confirmations = sa.Table(
    "confirmations",
    sa.MetaData(),
    sa.Column("order_id", sa.Text),
    sa.Column("amount", sa.Integer, sa.CheckConstraint("amount >= 0")),
)


@pytest.fixture
def engine(engine: sa.Engine) -> sa.Engine:
    confirmations.create(engine)
    return engine


def _dead(consumer: Any) -> float:
    sample = consumer.metrics.registry.get_sample_value
    value: float = (
        sample(
            "oncely_consumer_dead_lettered_total",
            {"effect": consumer.effect.name, "reason": "handler_failed"},
        )
        or 0.0
    )
    return value


def _declare(shop: Shop, kind: str) -> None:
    def confirm(event: OrderPlaced, ctx: EffectContext[Any]) -> None:
        ctx.stage(OrderConfirmed(order_id=event.order_id))
        # A negative amount fails the check when the batch's rows are written, after the
        # follow-ups: those of the failing order must roll back with it.
        ctx.insert(confirmations, {"order_id": event.order_id, "amount": event.amount})

    async def confirm_async(event: OrderPlaced, ctx: EffectContext[AsyncSession]) -> None:
        await ctx.session.execute(sa.text("SELECT 1"))
        confirm(event, ctx)

    def confirm_batch(batch: list[tuple[OrderPlaced, EffectContext[Session]]]) -> None:
        for event, ctx in batch:
            confirm(event, ctx)

    handler = {"sync": confirm, "async": confirm_async, "batch": confirm_batch}[kind]
    policy = FailurePolicy(max_attempts=1, initial_backoff_seconds=0.01)
    shop.effects.effect("confirm", on=OrderPlaced, failure=policy, batch=kind == "batch")(handler)


@pytest.mark.parametrize("kind", ["sync", "async", "batch"])
def test_follow_ups_commit_once_with_their_cause_and_its_trace(
    kind: str,
    shop: Shop,
    engine: sa.Engine,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _declare(shop, kind)
    orders = [(str(uuid.uuid4()), OrderPlaced(order_id=f"o-{n}", amount=n)) for n in range(120)]
    _publish(kafka_bootstrap, shop, orders)
    spied = StatementSpy(monkeypatch)
    with running_consumers(shop.effects, ["confirm"], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _applied(consumer) == 120, timeout=60)
    rows = _follow_ups(engine)
    by_id = {event_id: (n, order) for n, (event_id, order) in enumerate(orders)}
    assert sorted(row.headers["causationId"] for row in rows) == sorted(by_id)
    for row in rows:
        n, order = by_id[row.headers["causationId"]]
        assert row.aggregateid == order.order_id
        assert row.topic == shop.registry.for_model(OrderConfirmed).topic
        assert row.headers["content-type"]
        assert trace_context_fields(row.tracingspancontext) == {"traceparent": _traceparent(n)}
    # The follow-ups of a batch are one INSERT (the helper's batches are up to 200 records):
    # a statement per follow-up would be 120.
    inserts = [s for s in spied if s.startswith("INSERT INTO oncely_outbox")]
    assert 1 <= len(inserts) <= 12, len(inserts)

    # Every order again, as after an offset reset, and one new order that fails when the batch's
    # rows are written (after its follow-up was): the receipts suppress the old ones, and the
    # failing one's follow-up rolls back with it.
    failing = (str(uuid.uuid4()), OrderPlaced(order_id="o-bad", amount=-1))
    _publish(kafka_bootstrap, shop, [*orders[:60], failing, *orders[60:]])
    with running_consumers(shop.effects, ["confirm"], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _duplicates(consumer) == 120 and _dead(consumer) == 1, timeout=60)
    assert len(_follow_ups(engine)) == 120
    assert scalar(engine, "SELECT count(*) FROM confirmations") == 120
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = 'confirm'") == 120


def test_a_traced_follow_up_is_a_child_of_the_span_that_staged_it(
    shop: Shop, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    _declare(shop, "sync")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    event_id = str(uuid.uuid4())
    _publish(kafka_bootstrap, shop, [(event_id, OrderPlaced(order_id="o-1", amount=1))])
    tracing = Tracing(provider)
    with running_consumers(shop.effects, ["confirm"], engine, kafka_bootstrap, tracing=tracing) as [
        consumer
    ]:
        wait_until(lambda: _applied(consumer) == 1, timeout=60)
    [process] = [s for s in exporter.get_finished_spans() if s.name.startswith("process ")]
    [row] = _follow_ups(engine)
    context = process.get_span_context()
    assert context is not None and context.trace_id == 1, "the record's trace"
    assert trace_context_fields(row.tracingspancontext)["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
    )
    assert row.headers["causationId"] == event_id
