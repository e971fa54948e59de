"""Dead-letter topics: ``<topic>.<effect>.dlq`` gets the original record with the reason.

The key and value are copied byte for byte; the original headers are kept and these are added:
``oncely.dlq.reason`` (``handler_failed`` or ``undecodable``), ``oncely.dlq.error.class``,
``oncely.dlq.error.message`` (at most 4,000 characters), ``oncely.dlq.attempts``,
``oncely.dlq.effect``, ``oncely.dlq.original.topic``, ``oncely.dlq.original.partition`` and
``oncely.dlq.original.offset``. A record counts as dead-lettered only once the DLQ topic's
broker has confirmed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.errors import OncelyError

_MAX_MESSAGE = 4000


class DeadLetterError(OncelyError):
    """The record could not be written to its dead-letter topic."""


def dlq_headers(
    message: Message, *, effect: str, reason: str, error_class: str, error: str, attempts: int
) -> list[tuple[str, str | bytes | None]]:
    raw = message.headers() or []
    original = list(raw.items() if isinstance(raw, dict) else raw)
    return [
        *original,
        ("oncely.dlq.reason", reason),
        ("oncely.dlq.error.class", error_class),
        ("oncely.dlq.error.message", error[:_MAX_MESSAGE]),
        ("oncely.dlq.attempts", str(attempts)),
        ("oncely.dlq.effect", effect),
        ("oncely.dlq.original.topic", message.topic() or ""),
        ("oncely.dlq.original.partition", str(message.partition())),
        ("oncely.dlq.original.offset", str(message.offset())),
    ]


class DeadLetters:
    """Produces records to dead-letter topics and waits for the broker's confirmation."""

    def __init__(self, config: Mapping[str, Any], *, timeout: float = 30.0) -> None:
        self._producer = Producer({**config, "enable.idempotence": True, "acks": "all"})
        self._admin = AdminClient(dict(config))
        self._timeout = timeout

    def ensure_topics(self, topics: Mapping[str, int]) -> None:
        """Create missing DLQ topics (name -> partitions) with the source's partition count."""
        existing = self._admin.list_topics(timeout=self._timeout).topics
        missing = [NewTopic(t, num_partitions=n) for t, n in topics.items() if t not in existing]
        for future in self._admin.create_topics(missing).values() if missing else []:
            try:
                future.result(self._timeout)
            except Exception as exc:  # another instance created it first
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise

    def send(
        self,
        message: Message,
        *,
        topic: str,
        headers: list[tuple[str, str | bytes | None]],
    ) -> None:
        """Write ``message`` to ``topic``; raise :class:`DeadLetterError` if not confirmed."""
        outcome: list[KafkaError | None] = []
        self._producer.produce(
            topic,
            key=message.key(),
            value=message.value(),
            headers=headers,
            on_delivery=lambda error, _msg: outcome.append(error),
        )
        self._producer.flush(self._timeout)
        if not outcome or outcome[0] is not None:
            raise DeadLetterError(
                f"dead-letter topic {topic!r} did not confirm the record: "
                f"{outcome[0] if outcome else 'timed out'}"
            )

    def close(self) -> None:
        self._producer.flush(self._timeout)
