"""The relay's pure decisions and its record contract."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from confluent_kafka import KafkaError

from oncely.relay import delivery
from oncely.runtime.retry import Backoff
from oncely.storage.stores.outbox.rows import OutboxRow


@pytest.mark.parametrize(
    ("attempts", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (9, 256.0), (10, 300.0), (50, 300.0)]
)
def test_backoff_doubles_up_to_the_maximum(attempts: int, expected: float) -> None:
    backoff = Backoff(first=1.0, maximum=300.0, jitter=0.5)  # the relay's
    assert backoff.delay(attempts, rand=lambda: 1.0) == expected
    assert backoff.delay(attempts, rand=lambda: 0.0) == expected / 2


@pytest.mark.parametrize(
    "code",
    [
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.LEADER_NOT_AVAILABLE,
    ],
)
def test_broker_trouble_never_goes_dead(code: int) -> None:
    error = KafkaError(code)
    assert delivery.is_transient(error)
    assert not delivery.goes_dead(error, 1000, max_attempts=5)


@pytest.mark.parametrize(
    "code",
    [KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC],
)
def test_permanent_errors_go_dead_at_max_attempts(code: int) -> None:
    error = KafkaError(code)
    assert not delivery.goes_dead(error, 4, max_attempts=5)
    assert delivery.goes_dead(error, 5, max_attempts=5)


def test_error_text_is_truncated_to_4000_characters() -> None:
    error = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "x" * 10_000)
    text = delivery.error_text(error)
    assert len(text) == 4000
    assert text.startswith("MSG_SIZE_TOO_LARGE: x")


def test_the_record_follows_the_contract() -> None:
    event_id = uuid.UUID("0190f0a0-0000-7000-8000-000000000001")
    available_at = datetime(2026, 11, 29, 9, 0, 0, 123000, tzinfo=UTC)
    headers = '{"x-tenant": "t-1", "content-type": "application/vnd.oncely.avro"}'
    trace = "traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n"
    columns = (str(event_id), 7, 3, "payments.transfer.completed", "transfer-9",
               "transfer.completed", b"\xc3\x01payload", headers, 1795942800123456,
               trace, available_at)  # fmt: skip
    row = OutboxRow.of(columns)
    assert row.id == event_id
    assert row.delayed
    assert row.key == b"transfer-9"
    assert row.timestamp_ms == 1795942800123
    assert row.kafka_headers() == [
        ("id", b"0190f0a0-0000-7000-8000-000000000001"),
        ("eventType", b"transfer.completed"),
        ("x-tenant", b"t-1"),
        ("content-type", b"application/vnd.oncely.avro"),
        ("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]
    assert row.kafka_headers(cloudevents_source="/shop")[5:] == [
        ("ce_id", b"0190f0a0-0000-7000-8000-000000000001"),
        ("ce_type", b"transfer.completed"),
        ("ce_time", b"2026-11-29T09:00:00.123456Z"),
        ("ce_source", b"/shop"),
        ("ce_specversion", b"1.0"),
    ]
    assert OutboxRow.of((*columns[:7], None, columns[8], None, None)).kafka_headers()[2:] == []
    assert OutboxRow.of((*columns[:7], '{"n": 1}', *columns[8:])).headers == (("n", b"1"),)


def test_snapshot_difference_follows_pgq_rule() -> None:
    from oncely.storage.stores.outbox.snapshots import Difference, Snapshot

    done = Snapshot.parse("100:110:100,105")
    reading = Snapshot.parse("105:120:105,112")
    assert str(done) == "100:110:100,105"
    difference = Difference.between(done, reading)
    # new: 100 (running in done, visible now) and [110, 120) except 112 (still running)
    assert (difference.low, difference.high) == (110, 120)
    assert difference.running == (112,)
    assert difference.finished == (100,)
    assert not difference.empty
    assert Difference.between(reading, reading).empty
    assert Difference.between(Snapshot.parse("5:7:5,6"), Snapshot.parse("5:8:5,6,7")).empty
    assert not Difference.between(Snapshot.parse("5:7:5,6"), Snapshot.parse("6:8:6,7")).empty


def test_a_shard_is_the_same_in_python_and_postgresql_terms() -> None:
    from oncely.storage.tables import shard_of

    assert shard_of("a", "k1", 32) == 4  # what PostgreSQL computed for the same row
    assert shard_of("topic-x", "key-7", 32) == 26
