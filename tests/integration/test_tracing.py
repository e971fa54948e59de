"""One trace from ``stage()`` to the effect and its task, through real Kafka and PostgreSQL.

The application's span around ``stage()`` is the root; the relay's PRODUCER span is its child,
each effect's CONSUMER span the child of that (sync and ``async`` handlers), and the span of the
task an effect enqueued the child of the effect's, linked to it as well. Spans are recorded by
the OpenTelemetry SDK's in-memory exporter, given to each component as its ``Tracing``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, Span, SpanKind, Tracer
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from oncely.consumers.effects import EffectContext, Effects
from oncely.events import Registry
from oncely.producer.staging import stage
from oncely.runtime.tracing import Tracing
from oncely.settings import TaskSettings
from oncely.tasks import Task, Tasks, TaskWorker
from tests.helpers import (
    fast_settings,
    publish_all,
    read_committed,
    read_topics,
    running_consumers,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration


class OrderPlaced(BaseModel):
    order_id: str
    email: str


@dataclass
class Pipeline:
    registry: Registry
    effects: Effects
    tasks: Tasks
    topic: str
    emailed: list[Task]


@pytest.fixture
def pipeline(kafka_admin: AdminClient) -> Iterator[Pipeline]:
    prefix = f"trace{uuid.uuid4().hex[:10]}."
    registry = Registry(topic_prefix=prefix)
    registry.register(OrderPlaced, name="order.placed", key="order_id", aggregate="order")
    effects = Effects(registry, group_prefix=prefix)
    tasks = Tasks()
    emailed: list[Task] = []

    @effects.effect("notify", on=OrderPlaced)
    def notify(event: OrderPlaced, ctx: EffectContext[Session]) -> None:
        ctx.enqueue_task("email.send", {"to": event.email, "by": "notify"})

    @effects.effect("notify-async", on=OrderPlaced)
    async def notify_async(event: OrderPlaced, ctx: EffectContext[AsyncSession]) -> None:
        ctx.enqueue_task("email.send", {"to": event.email, "by": "notify-async"})

    @tasks.handler("email.send")
    def send(task: Task) -> None:
        emailed.append(task)

    [topic] = registry.topics()
    kafka_admin.create_topics([NewTopic(topic, num_partitions=2)])[topic].result(30)
    yield Pipeline(registry, effects, tasks, topic, emailed)
    for future in kafka_admin.delete_topics([topic]).values():
        future.result(30)


@dataclass
class Spans:
    """Spans recorded in memory: the shop's tracer starts the trace, ``tracing`` hands the
    provider to oncely, ``finished()`` is every span ended so far."""

    provider: TracerProvider
    exporter: InMemorySpanExporter

    @property
    def tracer(self) -> Tracer:
        return self.provider.get_tracer("shop")

    @property
    def tracing(self) -> Tracing:
        return Tracing(self.provider)

    def finished(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def spans() -> Spans:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Spans(provider, exporter)


def _run_tasks(engine: sa.Engine, tasks: Tasks, tracing: Tracing, done: Callable[[], bool]) -> None:
    worker = TaskWorker(
        engine=engine,
        tasks=tasks,
        settings=TaskSettings(poll_interval_seconds=0.2),
        tracing=tracing,
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(done, timeout=30)
    finally:
        worker.stop()
        thread.join(timeout=30)


def _traceparent(span: ReadableSpan | Span) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _one(spans: list[ReadableSpan], name: str, **attributes: object) -> ReadableSpan:
    found = [
        s
        for s in spans
        if s.name == name
        and all((s.attributes or {}).get(key) == value for key, value in attributes.items())
    ]
    assert len(found) == 1, f"{len(found)} spans {name!r} {attributes} in {[s.name for s in spans]}"
    return found[0]


def test_one_trace_from_stage_to_the_effects_and_their_tasks(
    engine: sa.Engine,
    kafka_bootstrap: str,
    pipeline: Pipeline,
    spans: Spans,
    relay_mode: dict[str, object],
) -> None:
    tracing = spans.tracing
    with (
        spans.tracer.start_as_current_span("place order"),
        Session(engine) as session,
        session.begin(),
    ):
        staged = stage(session, OrderPlaced(order_id="o-1", email="a@example.com"))
    publish_all(
        engine, kafka_bootstrap, 1, fast_settings(**relay_mode), tracing=tracing, timeout=30
    )
    receipts = "SELECT count(*) FROM oncely_receipts"
    with running_consumers(
        pipeline.effects, ["notify", "notify-async"], engine, kafka_bootstrap, tracing=tracing
    ):
        wait_until(lambda: scalar(engine, receipts) == 2, timeout=60)
    _run_tasks(engine, pipeline.tasks, tracing, lambda: len(pipeline.emailed) == 2)

    finished = spans.finished()
    root = _one(finished, "place order")
    send = _one(finished, f"send {pipeline.topic}")
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}, "one trace"
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == root.context.span_id
    assert send.attributes is not None
    assert send.attributes["messaging.system"] == "kafka"
    assert send.attributes["messaging.destination.name"] == pipeline.topic
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.message.id"] == str(staged.id)
    assert send.status.is_ok and "messaging.kafka.offset" in send.attributes

    [record] = read_committed(kafka_bootstrap, [pipeline.topic])
    traceparent = _traceparent(send)
    assert record.headers["traceparent"].decode() == traceparent, "the relay's span goes on"

    for effect in ("notify", "notify-async"):
        process = _one(finished, f"process {pipeline.topic}", **{"oncely.effect": effect})
        assert process.kind is SpanKind.CONSUMER
        assert process.parent is not None and process.parent.span_id == send.context.span_id
        assert [link.context.span_id for link in process.links] == [send.context.span_id]
        assert process.attributes is not None
        assert process.attributes["messaging.consumer.group.name"] == pipeline.effects.group_id(
            effect
        )
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.message.id"] == str(staged.id)
        assert process.attributes["messaging.destination.partition.id"] == str(record.partition)
        assert process.attributes["messaging.kafka.offset"] == record.offset
        [task] = [t for t in pipeline.emailed if t.payload["by"] == effect]
        run = _one(finished, "task email.send", **{"oncely.task.id": str(task.id)})
        assert run.parent is not None and run.parent.span_id == process.context.span_id
        assert [link.context.span_id for link in run.links] == [process.context.span_id]
        assert run.status.is_ok


def test_a_relay_that_does_not_trace_forwards_the_staged_context(
    engine: sa.Engine,
    kafka_bootstrap: str,
    pipeline: Pipeline,
    spans: Spans,
) -> None:
    with (
        spans.tracer.start_as_current_span("place order") as root,
        Session(engine) as session,
        session.begin(),
    ):
        stage(session, OrderPlaced(order_id="o-2", email="b@example.com"))
    with Session(engine) as session, session.begin():
        stage(session, OrderPlaced(order_id="o-3", email="c@example.com"))  # no span
    untraced = Tracing(NoOpTracerProvider())
    publish_all(engine, kafka_bootstrap, 2, tracing=untraced, timeout=30)
    records = {r.key: r for r in read_topics(kafka_bootstrap, [pipeline.topic])}
    context = root.get_span_context()
    assert records["o-2"].headers["traceparent"].decode() == _traceparent(root)
    assert "traceparent" not in records["o-3"].headers
    with running_consumers(
        pipeline.effects, ["notify"], engine, kafka_bootstrap, tracing=spans.tracing
    ):
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 2, timeout=60)
    processed = [s for s in spans.finished() if s.name.startswith("process ")]
    by_parent = {s.parent.span_id if s.parent else None for s in processed}
    assert by_parent == {context.span_id, None}, "the staged span, and a new trace for o-3"
