"""How many records the outbox's topics hold in all: the console's publish rate is its change.

The sum of the topics' high watermarks grows by one for every record appended (the relay's,
a republish's; in exactly-once mode also a transaction's commit marker), so two samples a few
seconds apart give the rate Kafka is taking the outbox's records at, with no access to the
relays' own metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

from confluent_kafka import Consumer, TopicPartition

from oncely.settings import ClientConfig


def appended(config: ClientConfig, topics: Sequence[str], *, timeout: float) -> int:
    """The sum of the high watermarks of every partition of ``topics`` (missing ones count
    0). Raises ``KafkaException`` when Kafka does not answer within ``timeout``."""
    consumer = Consumer({**config, "group.id": "oncely-throughput", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=timeout).topics
        total = 0
        for topic in topics:
            if topic not in metadata or metadata[topic].error is not None:
                continue
            for partition in metadata[topic].partitions:
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=timeout
                )
                total += high
        return total
    finally:
        consumer.close()
