"""A consumer group's committed offsets, read without joining the group.

Read with a plain ``Consumer.committed()`` under the group's id (it never subscribes, so the
group's members are undisturbed), retrying while the group coordinator is still loading. Not
``AdminClient.list_consumer_group_offsets``: on a fresh broker it can crash the process for a
group that was never used (librdkafka issue 5040).
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from oncely.settings import ClientConfig

_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


def committed_offsets(
    config: ClientConfig,
    group: str,
    partitions: list[TopicPartition],
    timeout: float,
) -> dict[tuple[str, int], int]:
    """The group's committed offset per (topic, partition); negative where it has none."""
    if not partitions:
        return {}
    lookup = Consumer({**config, "group.id": group, "enable.auto.commit": False})
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                found = lookup.committed(partitions, timeout=timeout)
                return {(tp.topic, tp.partition): tp.offset for tp in found}
            except KafkaException as exc:
                error = exc.args[0]
                retry = error.retriable() or error.code() in _COORDINATOR_NOT_READY
                if not retry or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        lookup.close()
