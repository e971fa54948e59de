"""Hostile records reach a consumer: each is dead-lettered with its reason, the consumer goes on.

Random bytes, truncated Avro, a wrong marker, a known fingerprint over another schema's body,
non-UTF-8 and oversized headers, a 10 MB value, a missing and a malformed ``id``: every one
lands in the DLQ (the 10 MB one without its value, which the DLQ topic cannot take) and a valid
event behind them is applied. The consumer runs as a process, so its memory can be watched
across rounds: it must not grow with what it has rejected.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from fastavro import parse_schema, schemaless_writer

from oncely.schemas import single_object
from oncely.schemas.codec import Codec
from tests.apps.ledger import App
from tests.helpers import read_topics, scalar, start_oncely, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]

BIG = 10 * 1024 * 1024
TOPIC_LIMIT = 12 * 1024 * 1024
BIG_ROUND = 6
OTHER_SCHEMA = parse_schema(
    {
        "type": "record",
        "name": "Other",
        "fields": [
            {"name": "flag", "type": "boolean"},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
        ],
    }
)


@pytest.fixture
def app(new_ledger: Callable[..., App]) -> App:
    """Not the shared ``app``: one partition, on a topic that takes records of up to
    TOPIC_LIMIT bytes."""
    return new_ledger(1, config={"max.message.bytes": str(TOPIC_LIMIT)}, prefix="hr")


Record = tuple[str, bytes, list[tuple[str, bytes]]]


def _hostile(app: App, codec: Codec, n: int) -> list[Record]:
    """(what, value, headers) of each hostile record, then a valid one."""
    event_type = app.registry.for_model(app.model)
    valid, _ = codec.encode(app.model(account_id="acc", amount=1, n=n))
    other = io.BytesIO()
    schemaless_writer(other, OTHER_SCHEMA, {"flag": True, "tags": ["x" * 30, "y"]})

    def ids() -> list[tuple[str, bytes]]:
        return [("id", str(uuid.uuid4()).encode()), ("eventType", event_type.name.encode())]

    return [
        ("random bytes", os.urandom(300), ids()),
        ("truncated avro", valid[:-3], ids()),
        ("wrong marker", b"\xc4" + valid[1:], ids()),
        ("foreign body", single_object.frame(event_type.fingerprint, other.getvalue()), ids()),
        ("non-utf8 header", valid, [*ids(), ("traceparent", b"\xff\xfe\xfd")]),
        ("10 MB value", os.urandom(BIG), ids()),
        ("10 MB valid-looking value", valid[:10] + b"\xff" * BIG, ids()),
        ("missing id", valid, ids()[1:]),
        ("id not a uuid", valid, [("id", b"12345; DROP TABLE x"), *ids()[1:]]),
        ("huge header", valid, [*ids(), ("x-big", b"h" * 100_000)]),
        ("valid", valid, ids()),
    ]


def _rss(pid: int) -> int:
    """Resident memory of a process, bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(240)
def test_hostile_records_are_dead_lettered_and_the_consumer_keeps_going(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    codec = Codec(registry=app.registry)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": TOPIC_LIMIT})
    log = tmp_path / "consume.log"
    with log.open("wb") as sink:
        consumer = start_oncely(
            *("consume", "tests.apps.ledger:effects", "--effect", "ledger"),
            *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
            env={**app.env, "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2"},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    memory: list[int] = []
    hostile = _hostile(app, codec, 1)
    valid = _hostile(app, codec, 2)[-1]
    big = [("10 MB value", os.urandom(BIG), valid[2][:1])] * BIG_ROUND
    # Round 1 reaches the consumer's memory peak (its fetch queue full of 10 MB records);
    # round 2 repeats the big records: a bounded consumer stays at that peak.
    rounds = [[*hostile[:-1], *big, hostile[-1]], [*big, valid]]
    try:
        for round_no, records in enumerate(rounds, start=1):
            for _, value, headers in records:
                producer.produce(app.topic, key=b"acc", value=value, headers=headers)
            assert producer.flush(60) == 0
            wait_until(
                lambda n=round_no: scalar(engine, "SELECT count(*) FROM ledger") == n,
                timeout=60,
            )
            assert consumer.poll() is None, log.read_text()
            memory.append(_rss(consumer.pid))
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(timeout=60) == 0, log.read_text()
    finally:
        if consumer.poll() is None:
            consumer.kill()

    dlq = read_topics(kafka_bootstrap, [app.effects.get("ledger").dlq_topic(app.topic)])
    assert len(dlq) == len(hostile) - 1 + 2 * BIG_ROUND
    reasons = {}
    for record, (what, value, _) in zip(dlq, hostile[:-1], strict=False):
        assert record.headers["oncely.dlq.reason"] == b"undecodable", what
        reasons[what] = record.headers["oncely.dlq.error.message"].decode()
        if len(value) >= BIG:
            assert record.headers["oncely.dlq.truncated"] == b"true" and record.value == b""
            assert record.headers["oncely.dlq.original.value.bytes"] == str(len(value)).encode()
        else:
            assert record.value == value, what
    assert "not UTF-8" in reasons["non-utf8 header"]
    assert "no 'id' header" in reasons["missing id"]
    assert "is not a UUID" in reasons["id not a uuid"]
    assert "bytes long" in reasons["huge header"]
    assert all(reasons.values()), reasons
    # The second round rejected 60 MB more: none of it may stay resident.
    growth = memory[-1] - memory[0]
    assert growth < 40 * 1024 * 1024, f"RSS grew {growth / 2**20:.0f} MiB: {memory}"
