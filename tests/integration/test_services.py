"""The ground everything stands on: a real broker and a real database, isolated per test."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient

from oncely.testing import Services

pytestmark = pytest.mark.integration


def test_broker_answers_and_reports_its_version(
    oncely_services: Services, kafka_admin: AdminClient
) -> None:
    metadata = kafka_admin.list_topics(timeout=10)
    assert len(metadata.brokers) == 1
    if oncely_services.origin == "oncely devstack":
        # The version comes from the broker's own start-up log line, not from our configuration.
        assert oncely_services.kafka_version.startswith("4.")


def test_keyed_record_round_trips_with_headers(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    reports: list[tuple[KafkaError | None, Message]] = []
    event_id = str(uuid.uuid4())
    producer.produce(
        topic,
        key=b"account-42",
        value=b"\x00\x01payload",
        headers=[("id", event_id.encode()), ("eventType", b"test.happened")],
        on_delivery=lambda err, msg: reports.append((err, msg)),
    )
    assert producer.flush(30) == 0
    [(error, delivered)] = reports
    assert error is None

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"g-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.subscribe([topic])
        received = None
        for _ in range(30):
            msg = consumer.poll(1.0)
            if msg is not None:
                assert msg.error() is None, msg.error()
                received = msg
                break
    finally:
        consumer.close()
    assert received is not None, "the record was not consumed back within 30 s"
    assert received.key() == b"account-42"
    assert received.value() == b"\x00\x01payload"
    assert received.headers() == [("id", event_id.encode()), ("eventType", b"test.happened")]
    assert (received.partition(), received.offset()) == (delivered.partition(), delivered.offset())


def test_commit_keeps_rows_and_rollback_leaves_nothing(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE notes (body text NOT NULL)"))
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO notes VALUES ('kept')"))
    conn = engine.connect()
    transaction = conn.begin()
    conn.execute(sa.text("INSERT INTO notes VALUES ('rolled back')"))
    transaction.rollback()
    conn.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT body FROM notes")).scalars().all() == ["kept"]
    engine.dispose()


@pytest.mark.parametrize("writer", ["first", "second"])
def test_each_test_gets_its_own_database(database_url: str, writer: str) -> None:
    # Both parametrisations create the same table: in a shared database the second would fail.
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE shared_name (writer text NOT NULL)"))
        conn.execute(sa.text("INSERT INTO shared_name VALUES (:w)"), {"w": writer})
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT writer FROM shared_name")).scalars().all() == [writer]
    engine.dispose()
