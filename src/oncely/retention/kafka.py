"""Where Kafka's logs start and end: each partition's low and high watermark, of the topics the
receipts' guard asks about by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future

from confluent_kafka import KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from oncely.retention.guard import Watermarks
from oncely.settings import ClientConfig


class KafkaUnansweredError(Exception):
    """Kafka did not answer in time: the receipts' guard refuses every partition that needs it."""


def watermarks(
    config: ClientConfig, topics: Iterable[str], *, timeout: float
) -> dict[str, Mapping[int, Watermarks] | None]:
    """topic -> each of its partitions' watermarks (the log start offset, the lowest offset it
    still holds, and the high watermark, the offset of its next record); ``None`` when Kafka
    says the topic does not exist (``UNKNOWN_TOPIC_OR_PART``: it holds none of its records).

    The topics are asked for by name (a principal's metadata of all topics leaves out those it
    may not Describe). A topic Kafka refused to describe (an authorization error) or did not
    answer about (any other error, for the topic or one of its partitions) is left out: the
    guard reads a missing topic as no answer, never as a deleted topic.

    Raises :class:`KafkaUnansweredError` when Kafka does not answer within ``timeout`` seconds
    at all.
    """
    wanted = sorted(set(topics))
    if not wanted:
        return {}
    # confluent-kafka's AdminClient has no close(): its handle is destroyed with its last
    # reference, this function's (no client outlives a call).
    admin = AdminClient(dict(config))
    try:
        found: dict[str, Mapping[int, Watermarks] | None] = {}
        numbers: dict[str, list[int]] = {}
        described = admin.describe_topics(TopicCollection(wanted), request_timeout=timeout)
        for topic, future in described.items():
            try:
                numbers[topic] = [p.id for p in future.result(timeout=timeout).partitions]
            except KafkaException as exc:
                if _code(exc) == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    found[topic] = None
        asked = [TopicPartition(topic, n) for topic, ns in numbers.items() for n in ns]
        lows = _offsets(admin, asked, OffsetSpec.earliest(), timeout)  # type: ignore[no-untyped-call]
        highs = _offsets(admin, asked, OffsetSpec.latest(), timeout)  # type: ignore[no-untyped-call]
        for topic, ns in numbers.items():
            if all((topic, n) in lows and (topic, n) in highs for n in ns):
                found[topic] = {n: Watermarks(lows[(topic, n)], highs[(topic, n)]) for n in ns}
        return found
    except TimeoutError as exc:
        raise KafkaUnansweredError(
            f"Kafka at {config.get('bootstrap.servers')} did not answer in {timeout:g} s"
        ) from exc
    except KafkaException as exc:
        raise KafkaUnansweredError(
            f"Kafka at {config.get('bootstrap.servers')} did not answer ({exc})"
        ) from exc


def _offsets(
    admin: AdminClient, asked: list[TopicPartition], spec: OffsetSpec, timeout: float
) -> dict[tuple[str, int], int]:
    """(topic, partition) -> the offset ``spec`` names, for those Kafka answered about."""
    if not asked:
        return {}
    futures: dict[TopicPartition, Future[object]] = admin.list_offsets(
        dict.fromkeys(asked, spec), request_timeout=timeout
    )
    answered = {}
    for tp, future in futures.items():
        try:
            info = future.result(timeout=timeout)
        except KafkaException:
            continue  # an error for this partition: no answer for its topic
        answered[(tp.topic, tp.partition)] = int(info.offset)  # type: ignore[attr-defined]
    return answered


def _code(exc: KafkaException) -> int | None:
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None
