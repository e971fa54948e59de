"""Dead-letter topics: ``<topic>.<effect>.dlq`` gets the original record with the reason.

The key and value are copied byte for byte; the original headers are kept and these are added:
``oncely.dlq.reason`` (``handler_failed`` or ``undecodable``), ``oncely.dlq.error.class``,
``oncely.dlq.error.message`` (at most 4,000 characters), ``oncely.dlq.attempts``,
``oncely.dlq.effect``, ``oncely.dlq.original.topic``, ``oncely.dlq.original.partition`` and
``oncely.dlq.original.offset``. A record counts as dead-lettered only once the DLQ topic's
broker has confirmed it.

A record too large for the dead-letter topic (a hostile 10 MB value, thousands of headers) is
dead-lettered without its value and original headers (and without its key if that is large),
with ``oncely.dlq.truncated`` = ``true`` and ``oncely.dlq.original.value.bytes``: the original
stays readable at its topic, partition and offset while the topic's retention keeps it. So
such a record cannot block its partition.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient

from oncely.errors import OncelyError
from oncely.runtime.reach import KafkaReach
from oncely.security import AuthWatch, wait_for_metadata
from oncely.topics import TopicSpec, ensure_topics
from oncely.wire import DLQ_HEADER_PREFIX

log = logging.getLogger(__name__)

_MAX_KEPT_KEY = 1024
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})


class DeadLetterError(OncelyError):
    """The record could not be written to its dead-letter topic."""


class DeadLetters:
    """Produces records to dead-letter topics and waits for the broker's confirmation."""

    def __init__(
        self, config: Mapping[str, Any], *, timeout: float = 30.0, reach: KafkaReach | None = None
    ) -> None:
        """``config``: the clients' settings; ``timeout``: seconds to wait for the broker;
        ``reach``: the process's watch over its clients' outages (default: their own)."""
        reach = reach or KafkaReach()
        self._producer = Producer(
            reach.client_config({**config, "enable.idempotence": True, "acks": "all"})
        )
        self._auth = AuthWatch()
        self._admin = AdminClient(reach.client_config({**config, "error_cb": self._auth}))
        self._timeout = timeout

    def poll(self) -> None:
        """Serve the clients' queued callbacks and log lines, without waiting (call it now and
        then: they queue up until then)."""
        self._producer.poll(0)
        self._admin.poll(0)

    def ensure_topics(
        self, topics: Sequence[TopicSpec], *, until: threading.Event | None = None
    ) -> None:
        """Create missing DLQ topics as declared (``dead_letter_topics`` of
        :mod:`oncely.topics`), through the same provisioning as ``oncely topics ensure``;
        log existing ones weaker than declared as warnings (it never alters them).

        Raises :class:`~oncely.security.KafkaAuthenticationError` (within about a second) when
        the broker refuses the credentials, :class:`DeadLetterError` when a topic cannot be
        created (the message names it and why), ``KafkaException`` when the broker cannot be
        reached, or, with ``until``, keeps waiting for the broker until ``until`` is set (then
        returns).
        """
        while True:
            try:
                wait_for_metadata(self._admin, self._auth, timeout=self._timeout)
                break
            except KafkaException as exc:
                if until is None:
                    raise
                log.warning("the broker cannot be reached, waiting for it: %s", exc)
                if until.wait(5.0):
                    return
        try:
            report = ensure_topics(self._admin, topics, timeout=self._timeout)
        except KafkaException as exc:  # e.g. not allowed to describe: creation is what matters
            log.warning("could not check the dead-letter topics: %s", exc)
            return
        for name in report.created:
            log.info("created dead-letter topic %s", name)
        for problem in report.mismatches:
            log.warning("dead-letter topic weaker than declared: %s", problem)
        if report.failed:
            raise DeadLetterError(
                f"cannot create dead-letter topics: {'; '.join(report.failed)} (create them "
                "with `oncely topics ensure --effects`)"
            )

    def send(
        self,
        message: Message,
        *,
        topic: str,
        headers: list[tuple[str, str | bytes | None]],
    ) -> None:
        """Write ``message`` to ``topic``; raise :class:`DeadLetterError` if not confirmed.

        A copy too large for the producer or the topic is replaced by a truncated one (see
        the module's documentation).
        """
        error = self._send(topic, message.key(), message.value(), headers)
        if error is not None and error.code() in _TOO_LARGE:
            key = message.key()
            value = message.value()
            own = [(name, text) for name, text in headers if name.startswith(DLQ_HEADER_PREFIX)]
            error = self._send(
                topic,
                key if key is None or len(key) <= _MAX_KEPT_KEY else None,
                None,
                [
                    *own,
                    (f"{DLQ_HEADER_PREFIX}truncated", "true"),
                    (f"{DLQ_HEADER_PREFIX}original.value.bytes", str(len(value or b""))),
                ],
            )
        if error is not None:
            raise DeadLetterError(
                f"dead-letter topic {topic!r} did not confirm the record: {error}"
            )

    def _send(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes | str | None,
        headers: list[tuple[str, str | bytes | None]],
    ) -> KafkaError | None:
        """Produce one record and wait for its report; the error, or ``None`` once confirmed."""
        outcome: list[KafkaError | None] = []
        try:
            self._producer.produce(
                topic,
                key=key,
                value=value,
                headers=headers,
                on_delivery=lambda error, _msg: outcome.append(error),
            )
        except KafkaException as exc:  # refused locally, e.g. larger than message.max.bytes
            refused: KafkaError = exc.args[0]
            return refused
        self._producer.flush(self._timeout)
        if not outcome:
            return KafkaError(KafkaError._TIMED_OUT, "no delivery report within the timeout")
        return outcome[0]

    def close(self) -> None:
        self._producer.flush(self._timeout)
