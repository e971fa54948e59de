"""The relay's pure decisions and its record contract."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from confluent_kafka import KafkaError

from oncely.relay import policy
from oncely.relay.records import ClaimedRow


@pytest.mark.parametrize(
    ("attempts", "expected"), [(1, 1.0), (2, 2.0), (3, 4.0), (9, 256.0), (10, 300.0), (50, 300.0)]
)
def test_backoff_doubles_up_to_the_maximum(attempts: int, expected: float) -> None:
    assert policy.backoff_seconds(attempts, base=1.0, maximum=300.0, jitter=lambda: 1.0) == expected
    assert policy.backoff_seconds(attempts, base=1.0, maximum=300.0, jitter=lambda: 0.0) == (
        expected / 2
    )


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
    assert policy.is_transient(error)
    assert not policy.goes_dead(error, 1000, max_attempts=5)


@pytest.mark.parametrize(
    "code",
    [KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC],
)
def test_permanent_errors_go_dead_at_max_attempts(code: int) -> None:
    error = KafkaError(code)
    assert not policy.goes_dead(error, 4, max_attempts=5)
    assert policy.goes_dead(error, 5, max_attempts=5)


def test_error_text_is_truncated_to_4000_characters() -> None:
    error = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "x" * 10_000)
    text = policy.error_text(error)
    assert len(text) == 4000
    assert text.startswith("MSG_SIZE_TOO_LARGE: x")


def test_the_record_follows_the_contract() -> None:
    event_id = uuid.UUID("0190f0a0-0000-7000-8000-000000000001")
    row = ClaimedRow(
        id=event_id,
        seq=7,
        topic="payments.transfer.completed",
        aggregateid="transfer-9",
        type="transfer.completed",
        payload=b"\xc3\x01payload",
        headers={"traceparent": "00-abc-def-01", "content-type": "application/vnd.oncely.avro"},
        attempts=1,
        created_at=datetime(2026, 11, 29, 9, 0, 0, 123000, tzinfo=UTC),
    )
    assert row.key == b"transfer-9"
    assert row.timestamp_ms == 1795942800123
    assert row.kafka_headers() == [
        ("id", b"0190f0a0-0000-7000-8000-000000000001"),
        ("eventType", b"transfer.completed"),
        ("traceparent", b"00-abc-def-01"),
        ("content-type", b"application/vnd.oncely.avro"),
    ]
