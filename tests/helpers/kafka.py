"""Kafka seen from a test: topics read back, events produced as the relay would, topics created
and deleted (once the broker lists the change), topic settings."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.helpers.probes import wait_until


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, bytes]
    #: The record's timestamp in ms (the producer's, on CreateTime topics).
    timestamp: int = 0
    #: Every header name in order, repeated names included (``headers`` keeps the last value).
    header_names: tuple[str, ...] = ()


def read_topics(bootstrap: str, topics: Sequence[str], *, timeout: float = 30) -> list[Record]:
    """Every record now in ``topics`` (read from the beginning up to the high watermarks)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    records: list[Record] = []
    try:
        metadata = consumer.list_topics(timeout=10)
        ends: dict[tuple[str, int], int] = {}
        assignment = []
        for topic in topics:
            for partition in metadata.topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=10
                )
                if high > low:
                    ends[(topic, partition)] = high
                    assignment.append(TopicPartition(topic, partition, low))
        consumer.assign(assignment)
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            topic, partition, offset = msg.topic() or "", msg.partition() or 0, msg.offset() or 0
            records.append(
                Record(
                    topic,
                    partition,
                    offset,
                    (msg.key() or b"").decode(),
                    msg.value() or b"",
                    {k: bytes(v or b"") for k, v in msg.headers() or []},  # type: ignore[misc]
                    msg.timestamp()[1],
                    tuple(name for name, _ in msg.headers() or []),
                )
            )
            if offset + 1 >= ends.get((topic, partition), 0):
                ends.pop((topic, partition), None)
        assert not ends, f"partitions not read to the end: {ends}"
    finally:
        consumer.close()
    return records


def read_committed(
    bootstrap: str, topics: Sequence[str], *, committed: bool = True, timeout: float = 30
) -> list[Record]:
    """Every record of ``topics`` a ``read_committed`` consumer reads from the beginning, up
    to the end of each partition (its last stable offset): committed transactions' records and
    those produced outside transactions, never an aborted or open transaction's. With
    ``committed=False``, every record on the broker (``read_uncommitted``, to the high
    watermark)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed" if committed else "read_uncommitted",
            "enable.partition.eof": True,
        }
    )
    records: list[Record] = []
    try:
        metadata = consumer.list_topics(timeout=10)
        assignment = [
            TopicPartition(topic, partition, OFFSET_BEGINNING)
            for topic in topics
            for partition in metadata.topics[topic].partitions
        ]
        consumer.assign(assignment)
        unread = {(tp.topic, tp.partition) for tp in assignment}
        deadline = time.monotonic() + timeout
        while unread and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:
                unread.discard((msg.topic() or "", msg.partition() or 0))
                continue
            assert error is None, error
            records.append(
                Record(
                    msg.topic() or "",
                    msg.partition() or 0,
                    msg.offset() or 0,
                    (msg.key() or b"").decode(),
                    msg.value() or b"",
                    {k: bytes(v or b"") for k, v in msg.headers() or []},  # type: ignore[misc]
                    msg.timestamp()[1],
                    tuple(name for name, _ in msg.headers() or []),
                )
            )
        assert not unread, f"partitions not read to the end: {unread}"
    finally:
        consumer.close()
    return records


#: The producer of :func:`publish_events`, kept for the next call to the same broker: a new
#: idempotent producer sends its first record only after its producer id, about 0.5 s later
#: (librdkafka's timer), and a test that publishes in steps paid that at each step.
_PRODUCERS: dict[str, Any] = {}
_LOG = logging.getLogger(__name__)


def close_producers() -> None:
    """Let :func:`publish_events`' producer go while Python runs (tests/conftest.py, at the
    session's end): one destroyed at the interpreter's exit prints its broker's refusals."""
    _PRODUCERS.clear()


def publish_events(
    bootstrap: str, codec: object, events: Sequence[tuple[uuid.UUID | str, object]]
) -> None:
    """Produce events as the relay would (id and eventType headers, codec value), in order; an
    id given as text goes in the ``id`` header as it is spelled."""
    from confluent_kafka import Producer
    from pydantic import BaseModel

    from oncely.schemas.codec import Codec

    assert isinstance(codec, Codec)
    producer = _PRODUCERS.get(bootstrap)
    if producer is None:
        _PRODUCERS.clear()  # a stopped test broker's producer goes (it logs only when flushed)
        producer = _PRODUCERS[bootstrap] = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": True, "logger": _LOG}
        )
    for event_id, event in events:
        assert isinstance(event, BaseModel)
        event_type = codec.registry.for_model(type(event))
        value, headers = codec.encode(event)
        producer.produce(
            event_type.topic,
            key=event_type.key_of(event).encode(),
            value=value,
            headers=[("id", str(event_id)), ("eventType", event_type.name), *headers.items()],
        )
    assert producer.flush(30) == 0


def set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Change one setting of ``topic`` on the broker (e.g. raise ``max.message.bytes``)."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource("topic", topic, incremental_configs=[entry])
    admin.incremental_alter_configs([resource])[resource].result(30)


def wait_listed(admin: AdminClient, *topics: str) -> None:
    """Wait until the broker lists ``topics``: a creation is acknowledged before every client
    sees it (on a loaded machine, the next listing may still miss it)."""
    wait_until(lambda: set(topics) <= set(admin.list_topics(timeout=10).topics), timeout=30)


def create_topic(admin: AdminClient, topic: str, *, partitions: int) -> None:
    """Create ``topic`` (unless it exists) and wait until the broker lists it."""
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions)])[topic].result(30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
    wait_listed(admin, topic)


def delete_topics(admin: AdminClient, topics: Sequence[str]) -> None:
    """Delete ``topics`` and wait until the broker no longer lists them: a deletion is
    acknowledged before it is visible, and a client listing meanwhile still sees the topic."""
    for future in admin.delete_topics(list(topics)).values():
        future.result(30)
    wait_until(lambda: not set(topics) & set(admin.list_topics(timeout=10).topics), timeout=30)


def delete_existing(admin: AdminClient, topics: Sequence[str]) -> None:
    """Delete those of ``topics`` that exist (as :func:`delete_topics`): a test's cleanup."""
    existing = set(admin.list_topics(timeout=10).topics)
    doomed = [topic for topic in topics if topic in existing]
    if doomed:
        delete_topics(admin, doomed)
