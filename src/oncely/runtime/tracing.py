"""OpenTelemetry spans of the pipeline, and the trace context that travels with a row.

oncely uses the OpenTelemetry API only. A process records spans when it has an SDK: run it under
``opentelemetry-instrument`` (``opentelemetry-distro``), set a global ``TracerProvider``, or pass
one to :class:`Tracing`. Without one nothing is recorded and each helper here costs a type check,
while the context staged with a row still travels on its record, so a consumer that traces
continues the trace. Spans follow OpenTelemetry's messaging semantic conventions:

- :func:`current_context_text`: ``stage()`` and ``enqueue_task()`` store the active context
  with the row (the ``tracingspancontext`` column, Java properties text; see
  :func:`oncely.wire.trace_context_text`), inside the caller's transaction; an effect's
  follow-up event (``ctx.stage``) stores its record's span's context, or without one
  :func:`record_context_text`, the context the record arrived with.
- :meth:`Tracing.send`: the relay produces a row that carries a context inside a PRODUCER span
  ``send <topic>`` whose parent is that context; the span's own context goes on the record in
  its place, and the span ends with the delivery report (partition, offset, or the error).
  Rows without a staged context are not traced (as Debezium's router with
  ``tracing.with.context.field.only``).
- :meth:`Tracing.process`: a consumer calls each handler inside a CONSUMER span
  ``process <topic>`` whose parent is the record's context, also added as a link; a batch
  handler's span links the context of each record it applies.
- :meth:`Tracing.task`: a task's attempt runs inside a span ``task <name>`` whose parent and link
  are the context active when it was enqueued (the effect's span, for a task an effect queued).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from oncely.wire import trace_context_fields, trace_context_text

__all__ = ["Sending", "Tracing", "current_context_text", "record_context_text"]

T = TypeVar("T")

_SCOPE = "oncely"
_SYSTEM = "kafka"
_NOT_RECORDING = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def current_context_text() -> str | None:
    """The active trace context (``traceparent``, ``tracestate``, ``baggage``) as the text a
    row stores, or ``None`` when no span is active."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return trace_context_text(carrier)


def record_context_text(headers: Mapping[str, str]) -> str | None:
    """The trace context a record's ``headers`` carry (the propagator's fields) as the text a
    row stores, or ``None`` when they carry none."""
    fields = propagate.get_global_textmap().fields
    return trace_context_text({name: value for name, value in headers.items() if name in fields})


@dataclass
class Sending:
    """One record produced inside its PRODUCER span."""

    span: trace.Span
    context: otel_context.Context
    #: The propagation fields of the span's context: the record's trace headers.
    fields: dict[str, str]

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The span is the active one (an instrumented Kafka client parents its span on it)."""
        token = otel_context.attach(self.context)
        try:
            yield
        finally:
            otel_context.detach(token)

    def reported(self, report: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """``report`` (a delivery report callback) that first ends the span with the outcome."""

        def on_delivery(error: Any, message: Any) -> None:
            if error is not None:
                self.span.set_status(Status(StatusCode.ERROR, error.str()))
                self.span.set_attribute("error.type", error.name())
            elif message is not None:
                self.span.set_attribute(
                    "messaging.destination.partition.id", str(message.partition())
                )
                self.span.set_attribute("messaging.kafka.offset", message.offset())
            self.span.end()
            report(error, message)

        return on_delivery

    def refused(self, error: Any) -> None:
        """The client refused the record at once: end the span as failed."""
        self.span.set_status(Status(StatusCode.ERROR, error.str()))
        self.span.set_attribute("error.type", error.name())
        self.span.end()


class Tracing:
    """The spans of one component, recorded by ``provider`` (default: the global provider as it
    is when a span starts; nothing is recorded while that is OpenTelemetry's no-op or proxy)."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider
        self._cached: tuple[trace.TracerProvider, trace.Tracer] | None = None

    def tracer(self) -> trace.Tracer | None:
        """The tracer spans start from, or ``None`` when no SDK records them."""
        provider = self._provider or trace.get_tracer_provider()
        if isinstance(provider, _NOT_RECORDING):
            return None
        cached = self._cached
        if cached is None or cached[0] is not provider:
            cached = self._cached = (provider, provider.get_tracer(_SCOPE))
        return cached[1]

    @property
    def enabled(self) -> bool:
        return self.tracer() is not None

    def send(
        self, *, topic: str, event_id: str, key: str, staged: Mapping[str, str]
    ) -> Sending | None:
        """Start the PRODUCER span of a row whose staged context is ``staged``; ``None`` when
        nothing records spans."""
        tracer = self.tracer()
        if tracer is None:
            return None
        parent = propagate.extract(staged)
        span = tracer.start_span(
            f"send {topic}",
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": _SYSTEM,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": topic,
                "messaging.message.id": event_id,
                "messaging.kafka.message.key": key,
            },
        )
        current = trace.set_span_in_context(span, parent)
        fields: dict[str, str] = {}
        propagate.inject(fields, context=current)
        return Sending(span, current, fields)

    @contextlib.contextmanager
    def process(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        event_id: str,
        group: str,
        effect: str,
        headers: Mapping[str, str],
    ) -> Iterator[None]:
        """A handler's call on one record, inside its CONSUMER span (active, so what the
        handler enqueues or traces is its child); an exception marks the span and propagates."""
        tracer = self.tracer()
        if tracer is None:
            yield
            return
        parent = propagate.extract(headers)
        links = _links([parent])
        with tracer.start_as_current_span(
            f"process {topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                **_consumer_attributes(topic, group, effect),
                "messaging.destination.partition.id": str(partition),
                "messaging.kafka.offset": offset,
                "messaging.message.id": event_id,
            },
        ):
            yield

    @contextlib.contextmanager
    def process_batch(
        self,
        *,
        topics: Sequence[str],
        group: str,
        effect: str,
        headers: Sequence[Mapping[str, str]],
    ) -> Iterator[None]:
        """A batch handler's call, inside one CONSUMER span linking every record's context."""
        tracer = self.tracer()
        if tracer is None:
            yield
            return
        destinations = sorted(set(topics))
        topic = destinations[0] if len(destinations) == 1 else "(several)"
        with tracer.start_as_current_span(
            f"process {topic}",
            context=otel_context.Context(),
            kind=SpanKind.CONSUMER,
            links=_links([propagate.extract(h) for h in headers]),
            attributes={
                **_consumer_attributes(topic, group, effect),
                "messaging.batch.message_count": len(headers),
            },
        ):
            yield

    def task(
        self,
        handler: Callable[[T], object],
        arg: T,
        *,
        name: str,
        task_id: str,
        attempt: int,
        staged: str | None,
    ) -> object:
        """``handler(arg)``, an attempt of task ``name``, inside its span: parent and link are
        the ``staged`` context (the enqueuer's). An awaitable result is wrapped so that the span
        covers it and ends when it is awaited."""
        tracer = self.tracer()
        if tracer is None:
            return handler(arg)
        parent = propagate.extract(trace_context_fields(staged))
        span = tracer.start_span(
            f"task {name}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=_links([parent]),
            attributes={
                "oncely.task.name": name,
                "oncely.task.id": task_id,
                "oncely.task.attempt": attempt,
            },
        )
        with trace.use_span(
            span, end_on_exit=False, record_exception=True, set_status_on_exception=True
        ):
            try:
                result = handler(arg)
            except BaseException:
                span.end()
                raise
        if inspect.isawaitable(result):
            return _ending(span, result)
        _settle(span, result)
        return result


async def _ending(span: trace.Span, awaitable: Awaitable[T]) -> T:
    with trace.use_span(
        span, end_on_exit=False, record_exception=True, set_status_on_exception=True
    ):
        try:
            result = await awaitable
        except BaseException:
            span.end()
            raise
    _settle(span, result)
    return result


def _settle(span: trace.Span, result: object) -> None:
    if result is False:  # a task handler's "not confirmed": it will be retried
        span.set_status(Status(StatusCode.ERROR, "not confirmed"))
    span.end()


def _consumer_attributes(topic: str, group: str, effect: str) -> dict[str, Any]:
    return {
        "messaging.system": _SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": topic,
        "messaging.consumer.group.name": group,
        "oncely.effect": effect,
    }


def _links(contexts: Sequence[otel_context.Context]) -> list[Link]:
    links = []
    for ctx in contexts:
        span_context = trace.get_current_span(ctx).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links
