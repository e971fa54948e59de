"""What happens to a record an effect cannot apply: its failure policy, and the dead letter.

A failing record is retried in place (its partition paused, sought back to it, resumed after a
backoff), then dead-lettered (produced to ``<topic>.<effect>.dlq``, confirmed, and only then
committed past) or its partition blocked, as the effect's :class:`FailurePolicy` says. A record
that cannot be decoded is dead-lettered at once. Every dead letter logs one WARNING line with
the reason and how to fix it (:func:`dead_letter_fix`), and is recorded in
``oncely_dead_lettered`` (when its ``id`` header names an event) before the offset moves past
it: completeness counts it as dead for the effect, not missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import KafkaException, Message

from oncely.consumers.apply import Failure, PartitionId, topic_partition
from oncely.consumers.dlq import DeadLetterError, DeadLetters
from oncely.consumers.effects import Effect
from oncely.consumers.gate import PartitionGate
from oncely.runtime.metrics import ConsumerMetrics
from oncely.schemas.errors import DecodeFailure
from oncely.storage.stores import dead_lettered
from oncely.wire import dlq_headers, id_header

log = logging.getLogger(__name__)

#: How long a partition waits before trying a dead letter again when the DLQ refused it.
_DEAD_LETTER_RETRY_SECONDS = 5.0


class FailureHandling:
    """Applies ``effect``'s failure policy to the records it could not apply.

    ``commit_past(tp, offset)`` stores and commits ``offset`` for ``tp``: it is called once a
    dead letter is confirmed and recorded in ``engine``'s ``oncely_dead_lettered``.
    """

    def __init__(
        self,
        effect: Effect,
        metrics: ConsumerMetrics,
        dead_letters: DeadLetters,
        gate: PartitionGate,
        commit_past: Callable[[PartitionId, int], None],
        engine: sa.Engine,
    ) -> None:
        self.engine = engine
        self.effect = effect
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.gate = gate
        self._commit_past = commit_past
        self._attempts: dict[tuple[str, int, int], int] = {}

    def handle(self, failure: Failure) -> None:
        """Retry, dead-letter or block ``failure``'s record (never raises for Kafka trouble)."""
        tp = failure.partition_id
        offset = failure.offset
        policy = self.effect.failure
        if failure.kind == "undecodable":
            self._dead_letter(failure, attempts=1, reason="undecodable")
            return
        self.metrics.failures.labels(self.effect.name).inc()
        key = (*tp, offset)
        attempts = self._attempts.get(key, 0) + 1
        self._attempts[key] = attempts
        where = {"effect": self.effect.name, "topic": tp[0], "partition": tp[1], "offset": offset}
        log.warning(
            "handler failed (attempt %d of %d): %r",
            attempts,
            policy.max_attempts,
            failure.error,
            extra=where,
        )
        if attempts < policy.max_attempts:
            self.gate.pause(tp, offset, resume_at=time.monotonic() + policy.backoff(attempts))
        elif policy.then == "dead_letter":
            self._dead_letter(failure, attempts=attempts, reason="handler_failed")
        else:
            self.gate.pause(tp, offset, resume_at=None)
            self.metrics.blocked.labels(self.effect.name).set(self.gate.blocked)
            log.error(
                "partition blocked by a failing record: fix and restart the consumer", extra=where
            )

    def _dead_letter(self, failure: Failure, *, attempts: int, reason: str) -> None:
        message = failure.message
        tp = topic_partition(message)
        offset = failure.offset
        error = failure.error
        error_class = "Undecodable" if isinstance(error, str) else type(error).__name__
        topic = self.effect.dlq_topic(tp[0])
        try:
            self.dead_letters.send(
                message,
                topic=topic,
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
            resume_at = time.monotonic() + _DEAD_LETTER_RETRY_SECONDS
            self.gate.pause(tp, offset, resume_at=resume_at)
            return
        if not self._recorded(message, reason):
            resume_at = time.monotonic() + _DEAD_LETTER_RETRY_SECONDS
            self.gate.pause(tp, offset, resume_at=resume_at)
            return
        self.metrics.dead_lettered.labels(self.effect.name, reason).inc()
        log.warning(
            "dead-lettered %s[%d]@%d to %s (%s): %s; to fix: %s",
            tp[0],
            tp[1],
            offset,
            topic,
            reason,
            error if isinstance(error, str) else f"{error_class}: {error}",
            dead_letter_fix(failure, effect=self.effect.name),
            extra={
                "effect": self.effect.name,
                "topic": tp[0],
                "partition": tp[1],
                "offset": offset,
                "reason": reason,
            },
        )
        self._attempts.pop((*tp, offset), None)
        self._commit_past(tp, offset + 1)
        self.gate.seek(tp, offset + 1)

    def _recorded(self, message: Message, reason: str) -> bool:
        """Record the dead letter of ``message``'s event (nothing when its ``id`` header names
        none); ``False`` when the database failed (the dead letter is sent again later)."""
        try:
            event_id = UUID(id_header(message) or "")
        except ValueError:
            return True
        tp = topic_partition(message)
        try:
            dead_lettered.record(
                self.engine,
                effect=self.effect.name,
                event_id=event_id,
                topic=tp[0],
                partition=tp[1],
                offset=message.offset() or 0,
                reason=reason,
            )
        except sa.exc.SQLAlchemyError as exc:
            log.error("could not record a dead letter in the database, retrying: %s", exc)
            return False
        return True


def dead_letter_fix(failure: Failure, *, effect: str) -> str:
    """How an operator repairs a dead-lettered record: the cause's fix, then the redrive."""
    tp = failure.partition_id
    redrive = (
        f"then redrive it with `oncely replay --app <module:effects> --effect {effect} "
        f"--to-offset {tp[0]}:{tp[1]}:{failure.offset} --execute` (consumers stopped)"
    )
    if failure.decode_failure is DecodeFailure.UNKNOWN_SCHEMA:
        cause = (
            "run `oncely schemas export --out <catalog>` with the writer's code, deploy that "
            "catalog with the consumer (--schemas-dir, ONCELY_SCHEMAS_DIR or ./schemas), restart it"
        )
    elif failure.decode_failure is DecodeFailure.INCOMPATIBLE_SCHEMA:
        cause = (
            "the writer's schema does not resolve to the code's: make the change compatible "
            "(`oncely schemas check`) and deploy it"
        )
    elif failure.kind == "undecodable":
        cause = "the record is not a valid event of its topic: find and fix its producer"
    else:
        cause = "fix the handler or the data it needs and deploy"
    return f"{cause}; {redrive}"
