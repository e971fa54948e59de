"""`oncely relay run` under `opentelemetry-instrument`, with the confluent-kafka instrumentation
enabled: each record carries one `traceparent`, in the trace staged with its row.

The relay process gets its SDK from `opentelemetry-distro` (spans printed by the console
exporter); the instrumentation wraps its Kafka producer, and its own "send" span becomes a child
of the relay's PRODUCER span, whose `traceparent` it replaces rather than adds to.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel
from sqlalchemy.orm import Session

from oncely.events import Registry
from oncely.producer.staging import stage_many
from tests.helpers import count_published, read_topics, start_oncely, wait_until

pytestmark = pytest.mark.acceptance


class Shipped(BaseModel):
    parcel_id: str


def _spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed (JSON objects one after another)."""
    decoder = json.JSONDecoder()
    spans, position = [], 0
    while (start := text.find("{", position)) != -1:
        span, position = decoder.raw_decode(text, start)
        spans.append(span)
    return spans


def test_an_instrumented_relay_sends_one_traceparent_in_the_staged_trace(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    registry = Registry(topic_prefix="")
    registry.register(Shipped, name=topic, key="parcel_id", aggregate="parcel", encoding="json")
    tracer = TracerProvider().get_tracer("shop")
    with (
        tracer.start_as_current_span("ship") as staging,
        Session(engine) as session,
        session.begin(),
    ):
        stage_many(session, [Shipped(parcel_id=f"p-{i}") for i in range(3)])
    staged = staging.get_span_context()

    relay = start_oncely(
        *("relay", "run", "--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
        env={
            "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2",
            "OTEL_SERVICE_NAME": "oncely-relay",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        },
        stdout=subprocess.PIPE,
        via=[str(Path(sys.executable).parent / "opentelemetry-instrument")],
    )
    try:
        wait_until(lambda: relay.poll() is None and count_published(engine) == 3, timeout=60)
    finally:
        relay.send_signal(signal.SIGTERM)
        output, errors = relay.communicate(timeout=60)
    assert relay.returncode == 0, errors[-3000:]

    spans = _spans(output)
    ours = [s for s in spans if s["name"] == f"send {topic}"]
    theirs = [s for s in spans if s["name"] == f"{topic} send"]  # the instrumentation's
    assert len(ours) == len(theirs) == 3, [s["name"] for s in spans]
    assert {s["parent_id"] for s in ours} == {f"0x{staged.span_id:016x}"}
    assert {s["context"]["trace_id"] for s in ours + theirs} == {f"0x{staged.trace_id:032x}"}
    assert {s["parent_id"] for s in theirs} == {s["context"]["span_id"] for s in ours}

    records = read_topics(kafka_bootstrap, [topic])
    assert len(records) == 3
    for record in records:
        assert record.header_names.count("traceparent") == 1, record.header_names
        _, trace_id, span_id, _ = record.headers["traceparent"].decode().split("-")
        assert int(trace_id, 16) == staged.trace_id
        assert f"0x{span_id}" in {s["context"]["span_id"] for s in theirs}
