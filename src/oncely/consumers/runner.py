"""The consumer loop of one effect: poll a batch, apply it once, commit the DB, then the offsets.

Per polled batch, one database transaction: for each record, in a savepoint, insert the receipt
``(event_id, effect)`` with ``ON CONFLICT DO NOTHING``; only when the receipt is new is the
handler called (its writes join the savepoint). The transaction commits, and only then are the
offsets stored and committed. A crash anywhere before the offset commit redelivers records
whose receipts already exist: they are counted as duplicates and not applied again.

A failing record stops its partition for the rest of the batch (later records of the same
partition, and so of the same key, never run ahead of it), and the committed offset stops just
before it. Then the failure policy acts: retry in place (pause the partition, seek back to the
record, resume after a backoff), then dead-letter it (produce it to ``<topic>.<effect>.dlq``,
confirmed, and only then commit past it) or block the partition. Records that cannot be decoded
(corrupt bytes, unknown schema, missing ``id``) are dead-lettered at once with the reason.
Nothing is skipped silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from sqlalchemy.orm import Session

from oncely.consumers.dlq import DeadLetterError, DeadLetters, dlq_headers
from oncely.consumers.effects import Effect, EffectContext
from oncely.consumers.records import Decoded, Undecodable, decode_record
from oncely.ops.failpoints import failpoint
from oncely.ops.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.security import AuthWatch
from oncely.settings import ConsumerSettings, KafkaSettings
from oncely.storage.queries import query

log = logging.getLogger(__name__)

_LAG_INTERVAL = 5.0
_TP = tuple[str, int]


def consumer_config(
    kafka: KafkaSettings, settings: ConsumerSettings, group_id: str
) -> dict[str, Any]:
    """librdkafka settings of an effect's consumer; the safety-critical ones are fixed."""
    return {
        **kafka.client_config(),
        "group.id": group_id,
        "session.timeout.ms": settings.session_timeout_ms,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "isolation.level": "read_committed",
    }


@dataclass
class _Failure:
    message: Message
    error: BaseException | str
    undecodable: bool


class EffectConsumer:
    """Consume the topics of one effect in its own group and apply each event once."""

    def __init__(
        self,
        *,
        effect: Effect,
        group_id: str,
        codec: Codec,
        engine: sa.Engine,
        kafka: KafkaSettings,
        settings: ConsumerSettings,
        metrics: ConsumerMetrics,
        dead_letters: DeadLetters,
    ) -> None:
        self.effect = effect
        self.group_id = group_id
        self.codec = codec
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.dead_letters = dead_letters
        self._types_by_topic = {t.topic: t for t in effect.event_types}
        self._auth = AuthWatch()  # refused credentials stop the consumer (retrying cannot help)
        self._consumer = Consumer(
            {**consumer_config(kafka, settings, group_id), "error_cb": self._auth}
        )
        self._attempts: dict[tuple[str, int, int], int] = {}
        self._paused: dict[_TP, float | None] = {}  # resume time, or None while blocked
        self.heartbeat = time.monotonic()
        self.database_ok = True
        self.joined = False

    # -- life cycle -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Apply events until ``stop`` is set; then commit what was applied and leave the group.

        Raises :class:`~oncely.security.KafkaAuthenticationError` when the broker refuses the
        credentials.
        """
        self._consumer.subscribe(
            self.effect.topics, on_assign=self._on_assign, on_revoke=self._on_revoke
        )
        next_lag = time.monotonic()
        try:
            while not stop.is_set():
                self.heartbeat = now = time.monotonic()
                self._resume_due(now)
                messages = self._consumer.consume(
                    num_messages=self.settings.batch_size,
                    timeout=self.settings.poll_timeout_seconds,
                )
                self._auth.check()
                if messages:
                    self._process(messages)
                if now >= next_lag:
                    self._update_lag()
                    next_lag = now + _LAG_INTERVAL
        finally:
            self._commit(asynchronous=False)
            self._consumer.close()

    def healthy(self) -> bool:
        return time.monotonic() - self.heartbeat < 60.0

    def ready(self) -> bool:
        """Healthy, the database answers, and the group has assigned partitions at least once."""
        return self.healthy() and self.database_ok and self.joined

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.joined = True
        log.info(
            "partitions assigned",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Everything applied so far has its offsets stored: commit them before letting go.
        self._commit(asynchronous=False)
        for tp in partitions:
            self._paused.pop((tp.topic, tp.partition), None)
        log.info(
            "partitions revoked",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    # -- one batch --------------------------------------------------------------------------

    def _process(self, messages: Sequence[Message]) -> None:
        batch: list[Message] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", error.str())
                continue
            if (message.topic() or "", message.partition() or 0) not in self._paused:
                batch.append(message)
        if not batch:
            return
        failpoint("consumer.after_poll")
        self.metrics.consumed.labels(self.effect.name).inc(len(batch))
        records = [
            decode_record(m, codec=self.codec, types_by_topic=self._types_by_topic) for m in batch
        ]
        try:
            next_offsets, failures = self._apply(records)
        except sa.exc.DBAPIError as exc:
            # The whole transaction rolled back: nothing applied, nothing committed. Seek back.
            self.database_ok = False
            log.warning("database failed, re-reading the batch: %s", exc.orig)
            for tp, offset in _first_offsets(batch).items():
                self._seek(tp, offset)
            time.sleep(1.0)
            return
        self.database_ok = True
        failpoint("consumer.after_db_commit_before_offset_commit")
        self._store_offsets(next_offsets)
        self._commit(asynchronous=True)
        for failure in failures:
            self._handle_failure(failure)

    def _apply(
        self, records: Sequence[Decoded | Undecodable]
    ) -> tuple[dict[_TP, int], list[_Failure]]:
        """One transaction over the batch; returns offsets to commit and the failures."""
        next_offsets: dict[_TP, int] = {}
        failures: list[_Failure] = []
        stopped: set[_TP] = set()
        with Session(self.engine) as session, session.begin():
            for record in records:
                message = record.message
                tp = (message.topic() or "", message.partition() or 0)
                if tp in stopped:
                    continue
                if isinstance(record, Undecodable):
                    failures.append(_Failure(message, record.reason, undecodable=True))
                    stopped.add(tp)
                    continue
                savepoint = session.begin_nested()
                try:
                    applied = self._apply_one(session, record)
                    savepoint.commit()
                except Exception as exc:  # the failure policy decides, nothing is swallowed
                    savepoint.rollback()
                    failures.append(_Failure(message, exc, undecodable=False))
                    stopped.add(tp)
                    continue
                next_offsets[tp] = (message.offset() or 0) + 1
                if applied:
                    self.metrics.applied.labels(self.effect.name).inc()
                else:
                    self.metrics.duplicates.labels(self.effect.name).inc()
            failpoint("consumer.after_effect_before_db_commit")
        return next_offsets, failures

    def _apply_one(self, session: Session, record: Decoded) -> bool:
        message = record.message
        inserted = session.execute(
            query("receipt_insert"),
            {
                "event_id": record.event_id,
                "effect": self.effect.name,
                "topic": message.topic(),
                "partition": message.partition(),
                "offset": message.offset(),
            },
        ).first()
        if inserted is None:
            return False
        context = EffectContext(
            session=session,
            effect=self.effect.name,
            event_id=record.event_id,
            event_type=record.event_type.name,
            topic=message.topic() or "",
            partition=message.partition() or 0,
            offset=message.offset() or 0,
            headers=record.headers,
        )
        started = time.perf_counter()
        self.effect.handler(record.event, context)
        session.flush()  # integrity errors surface here, inside the record's savepoint
        self.metrics.handler_latency.labels(self.effect.name).observe(time.perf_counter() - started)
        return True

    # -- failures ---------------------------------------------------------------------------

    def _handle_failure(self, failure: _Failure) -> None:
        message = failure.message
        tp = (message.topic() or "", message.partition() or 0)
        offset = message.offset() or 0
        policy = self.effect.failure
        if failure.undecodable:
            self._dead_letter(failure, attempts=1, reason="undecodable")
            return
        self.metrics.failures.labels(self.effect.name).inc()
        key = (*tp, offset)
        attempts = self._attempts.get(key, 0) + 1
        self._attempts[key] = attempts
        log.warning(
            "handler failed (attempt %d of %d): %r",
            attempts,
            policy.max_attempts,
            failure.error,
            extra={
                "effect": self.effect.name,
                "topic": tp[0],
                "partition": tp[1],
                "offset": offset,
            },
        )
        if attempts < policy.max_attempts:
            self._pause(tp, offset, resume_at=time.monotonic() + policy.backoff(attempts))
        elif policy.then == "dead_letter":
            self._dead_letter(failure, attempts=attempts, reason="handler_failed")
        else:
            self._pause(tp, offset, resume_at=None)
            self.metrics.blocked.labels(self.effect.name).set(
                sum(1 for resume in self._paused.values() if resume is None)
            )
            log.error(
                "partition blocked by a failing record: fix and restart the consumer",
                extra={
                    "effect": self.effect.name,
                    "topic": tp[0],
                    "partition": tp[1],
                    "offset": offset,
                },
            )

    def _dead_letter(self, failure: _Failure, *, attempts: int, reason: str) -> None:
        message = failure.message
        tp = (message.topic() or "", message.partition() or 0)
        offset = message.offset() or 0
        error = failure.error
        error_class = "Undecodable" if isinstance(error, str) else type(error).__name__
        try:
            self.dead_letters.send(
                message,
                topic=self.effect.dlq_topic(tp[0]),
                headers=dlq_headers(
                    message,
                    effect=self.effect.name,
                    reason=reason,
                    error_class=error_class,
                    error=str(error),
                    attempts=attempts,
                ),
            )
        except (DeadLetterError, KafkaException, BufferError) as exc:
            log.error("could not dead-letter a record, retrying: %s", exc)
            self._pause(tp, offset, resume_at=time.monotonic() + 5.0)
            return
        self.metrics.dead_lettered.labels(self.effect.name, reason).inc()
        self._attempts.pop((*tp, offset), None)
        self._store_offsets({tp: offset + 1})
        self._commit(asynchronous=True)
        self._seek(tp, offset + 1)

    def _pause(self, tp: _TP, offset: int, *, resume_at: float | None) -> None:
        partition = TopicPartition(tp[0], tp[1], offset)
        self._consumer.pause([partition])
        self._seek(tp, offset)
        self._paused[tp] = resume_at

    def _resume_due(self, now: float) -> None:
        due = [tp for tp, at in self._paused.items() if at is not None and at <= now]
        if due:
            self._consumer.resume([TopicPartition(t, p) for t, p in due])
            for tp in due:
                del self._paused[tp]

    def _seek(self, tp: _TP, offset: int) -> None:
        try:
            self._consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except KafkaException as exc:  # no longer assigned: the new owner starts from the commit
            log.info("seek skipped: %s", exc)

    # -- offsets ----------------------------------------------------------------------------

    def _store_offsets(self, next_offsets: dict[_TP, int]) -> None:
        if next_offsets:
            try:
                self._consumer.store_offsets(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in next_offsets.items()]
                )
            except KafkaException as exc:  # revoked meanwhile: redelivery is absorbed
                log.info("offsets not stored: %s", exc)

    def _commit(self, *, asynchronous: bool) -> None:
        try:
            if asynchronous:
                self._consumer.commit(asynchronous=True)
            else:
                self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", exc)

    def _update_lag(self) -> None:
        try:
            assigned = self._consumer.assignment()
            positions = self._consumer.position(assigned)
        except KafkaException:
            return
        for tp in positions:
            try:
                _, high = self._consumer.get_watermark_offsets(tp, timeout=2, cached=True)
            except KafkaException:
                continue
            lag = high - tp.offset if tp.offset >= 0 else high
            self.metrics.lag.labels(self.effect.name, tp.topic, str(tp.partition)).set(max(0, lag))


def _first_offsets(messages: Sequence[Message]) -> dict[_TP, int]:
    first: dict[_TP, int] = {}
    for message in messages:
        tp = (message.topic() or "", message.partition() or 0)
        first.setdefault(tp, message.offset() or 0)
    return first


def _names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]
