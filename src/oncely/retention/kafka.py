"""Where Kafka's logs start: the lowest offset each topic partition still holds (its low
watermark), for the receipts' guard."""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from oncely.settings import ClientConfig


class KafkaUnansweredError(Exception):
    """Kafka did not answer in time: the receipts' guard refuses every partition that needs it."""


def log_starts(
    config: ClientConfig, wanted: Iterable[tuple[str, int]], *, timeout: float
) -> dict[tuple[str, int], int | None]:
    """(topic, partition) -> its log start offset; ``None`` when the topic or the partition no
    longer exists (Kafka holds none of its records).

    Raises :class:`KafkaUnansweredError` when Kafka does not answer within ``timeout`` seconds.
    """
    wanted = sorted(set(wanted))
    if not wanted:
        return {}
    admin = AdminClient(dict(config))
    reader = Consumer({**config, "group.id": "oncely-retention", "enable.auto.commit": False})
    try:
        topics = admin.list_topics(timeout=timeout).topics
        starts: dict[tuple[str, int], int | None] = {}
        for topic, number in wanted:
            if topic not in topics or number not in topics[topic].partitions:
                starts[(topic, number)] = None
                continue
            low, _ = reader.get_watermark_offsets(TopicPartition(topic, number), timeout=timeout)
            starts[(topic, number)] = low
        return starts
    except KafkaException as exc:
        raise KafkaUnansweredError(
            f"Kafka at {config.get('bootstrap.servers')} did not answer ({exc})"
        ) from exc
    finally:
        reader.close()
