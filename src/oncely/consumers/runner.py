"""The consumer loop of one effect: poll a batch, apply it once, commit the DB, then the offsets.

Each polled batch is applied by :class:`~oncely.consumers.apply.Applier` in one database
transaction per lane (receipts and effects together); only then are the offsets stored and
committed. A crash anywhere before the offset commit redelivers records whose receipts already
exist: they are counted as duplicates and not applied again.

Batches are applied on a thread of their own while the loop fetches and reads the next one
(one batch in flight): offsets are still stored and committed batch after batch, each after
its batch's commit. A fetch never waits out a timeout while records are there: it takes what
is buffered, and only when nothing is does it wait for the first record, then takes the rest
that arrived with it. An ``async`` effect's batches run on an asyncio event loop on that
thread, its lanes as concurrent tasks.

With ``lanes`` > 1 (``ONCELY_CONSUMER_LANES``) the batch is split by record key over that many
worker threads, each applying its share in its own transaction: a key always lands on the same
lane, so its records apply in order, while other keys proceed in parallel. The offset committed
for a partition never passes its lowest record that was not applied: records of other keys after
it that were applied are read again and suppressed by their receipts.

A failing record stops its partition (in its lane) for the rest of the batch, and the committed
offset stops just before it. Then the failure policy acts: retry in place (pause the partition,
seek back to the record, resume after a backoff), then dead-letter it (produce it to
``<topic>.<effect>.dlq``, confirmed, and only then commit past it) or block the partition.
Records that cannot be decoded (corrupt bytes, unknown schema, missing ``id``) are dead-lettered
at once with the reason. Every dead-lettered record logs one WARNING line with the reason and
how to fix it (:func:`dead_letter_fix`). Nothing is skipped silently. With lanes, ``block``
stops the partition at the failing record, but records of other keys after it may already have
been applied.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from oncely.consumers.apply import (
    Applier,
    BatchResult,
    Failure,
    PartitionId,
    Record,
    topic_partition,
)
from oncely.consumers.dlq import DeadLetterError, DeadLetters
from oncely.consumers.effects import Effect
from oncely.consumers.membership import Membership
from oncely.consumers.records import read_envelope
from oncely.runtime.failpoints import failpoint
from oncely.runtime.metrics import ConsumerMetrics
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeFailure
from oncely.security import AuthWatch
from oncely.settings import ConsumerSettings, KafkaSettings
from oncely.wire import dlq_headers

log = logging.getLogger(__name__)

_LAG_INTERVAL = 5.0


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
        "queued.max.messages.kbytes": settings.prefetch_kbytes,
    }


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
        self._config = {**consumer_config(kafka, settings, group_id), "error_cb": self._auth}
        self._consumer = Consumer(self._config)
        self._async_engine = _async_engine(engine, settings.lanes) if effect.is_async else None
        self._applier = Applier(effect, engine, metrics, codec, self._async_engine)
        self._apply_thread = ThreadPoolExecutor(1, thread_name_prefix=f"apply-{effect.name}")
        self._lanes = (
            ThreadPoolExecutor(settings.lanes, thread_name_prefix=f"lane-{effect.name}")
            if settings.lanes > 1 and not effect.is_async
            else None
        )
        self._event_loop: asyncio.Runner | None = None  # created on the apply thread
        self._pending: Future[list[BatchResult]] | None = None
        self._reset: set[PartitionId] = set()  # partitions sought or paused since the fetch
        self._attempts: dict[tuple[str, int, int], int] = {}
        self._paused: dict[PartitionId, float | None] = {}  # resume time, or None while blocked
        self.heartbeat = time.monotonic()
        self.database_ok = True
        self.membership = Membership(
            bound=settings.assignment_timeout_seconds, started=self.heartbeat
        )
        self._idle_reported = False

    # -- life cycle -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Apply events until ``stop`` is set; then commit what was applied and leave the group.

        A consumer left out of its group (its assignment lost, no new one) for longer than
        ``assignment_timeout_seconds`` recreates its Kafka client, which joins the group afresh.

        Raises :class:`~oncely.security.KafkaAuthenticationError` when the broker refuses the
        credentials.
        """
        self._subscribe()
        next_lag = time.monotonic()
        try:
            while not stop.is_set():
                self.heartbeat = now = time.monotonic()
                self._watch_membership(now)
                self._resume_due(now)
                self._reset.clear()
                messages = self._fetch(0.0 if self._pending else self.settings.poll_timeout_seconds)
                self._auth.check()
                records = self._read(messages)
                self._finish_pending()
                if self._reset:  # records read before their partition was sought or paused
                    records = [r for r in records if topic_partition(r.message) not in self._reset]
                if records:
                    failpoint("consumer.after_poll")
                    self.metrics.consumed.labels(self.effect.name).inc(len(records))
                    self._pending = self._apply_thread.submit(self._apply, records)
                if now >= next_lag:
                    self._update_lag()
                    next_lag = now + _LAG_INTERVAL
        finally:
            try:
                self._finish_pending()
                self._commit(asynchronous=False)
                self._consumer.close()
            finally:
                self._apply_thread.submit(self._close_event_loop).result()
                self._apply_thread.shutdown()
                if self._lanes is not None:
                    self._lanes.shutdown()

    def healthy(self) -> bool:
        return time.monotonic() - self.heartbeat < 60.0

    def ready(self) -> bool:
        """Healthy, the database answers, the group assigned partitions at least once, and the
        consumer has not been without any for longer than ``assignment_timeout_seconds``."""
        return self.healthy() and self.database_ok and self.membership.ready(time.monotonic())

    def _subscribe(self) -> None:
        self._consumer.subscribe(
            self.effect.topics,
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.assigned(_ids(partitions), time.monotonic())
        log.info(
            "partitions assigned",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Finish the batch in flight, then commit everything applied before letting go.
        self._finish_pending()
        self._commit(asynchronous=False)
        self._let_go(partitions, lost=False)
        log.info(
            "partitions revoked",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The group already gave them away: no commit (the broker would refuse it), and what
        # was applied past the last commit is redelivered to the new owner and suppressed.
        self._let_go(partitions, lost=True)
        log.warning(
            "partitions lost: the group dropped this consumer (session timed out); rejoining",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    def _let_go(self, partitions: list[TopicPartition], *, lost: bool) -> None:
        for tp in partitions:
            self._paused.pop((tp.topic, tp.partition), None)
        self.membership.revoked(_ids(partitions), time.monotonic(), lost=lost)

    def _watch_membership(self, now: float) -> None:
        """Report a consumer idle past the bound once; recreate one stranded out of its group."""
        idle = self.membership.unassigned_for(now)
        if idle <= self.membership.bound:
            self._idle_reported = False
            return
        if self.membership.stranded(now):
            log.warning(
                "no partitions for %.0f s and not rejoining the group: recreating the Kafka"
                " consumer",
                idle,
                extra={"effect": self.effect.name, "group": self.group_id},
            )
            self._recreate(now)
        elif self.membership.in_group and not self._idle_reported:
            self._idle_reported = True
            log.warning(
                "in the group but given no partitions for %.0f s (more members than"
                " partitions?): not ready",
                idle,
                extra={"effect": self.effect.name, "group": self.group_id},
            )

    def _recreate(self, now: float) -> None:
        """A new Kafka client in place of one that stopped rejoining; the old one is closed on
        a thread of its own (it holds no partitions, so nothing is left to commit)."""
        self._finish_pending()  # its offsets go to the old client (refused if not assigned)
        stale = self._consumer
        self._consumer = Consumer(self._config)
        self._paused.clear()
        self.membership.restarted(now)
        self.metrics.rejoins.labels(self.effect.name).inc()
        self._subscribe()
        threading.Thread(
            target=_close_quietly, args=(stale,), name=f"close-{self.effect.name}", daemon=True
        ).start()

    # -- one batch --------------------------------------------------------------------------

    def _fetch(self, wait: float) -> list[Message]:
        """Up to ``batch_size`` records: those already buffered, else (when ``wait`` > 0) the
        first to arrive within ``wait`` seconds and those that came with it."""
        size = self.settings.batch_size
        messages = self._consumer.consume(num_messages=size, timeout=0)
        if messages or wait <= 0:
            return messages
        first = self._consumer.poll(wait)
        if first is None:
            return []
        return (
            [first, *self._consumer.consume(num_messages=size - 1, timeout=0)]
            if size > 1
            else [first]
        )

    def _read(self, messages: Sequence[Message]) -> list[Record]:
        """The envelopes of the batch's records (values are decoded only for new events)."""
        records: list[Record] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", error.str())
                continue
            if topic_partition(message) not in self._paused:
                records.append(read_envelope(message, types_by_topic=self._types_by_topic))
        return records

    def _apply(self, records: Sequence[Record]) -> list[BatchResult]:
        """Apply one batch (on the apply thread): one transaction per lane."""
        lanes = self.settings.lanes
        if self._async_engine is not None:
            if self._event_loop is None:
                self._event_loop = asyncio.Runner()
            runs = split_lanes(records, lanes) if lanes > 1 else [records]
            return self._event_loop.run(self._apply_async(runs))
        if self._lanes is None:
            return [self._applier.apply(records)]
        return list(self._lanes.map(self._applier.apply, split_lanes(records, lanes)))

    async def _apply_async(self, runs: Sequence[Sequence[Record]]) -> list[BatchResult]:
        return list(await asyncio.gather(*(self._applier.apply_async(run) for run in runs)))

    def _close_event_loop(self) -> None:
        if self._event_loop is not None:
            if self._async_engine is not None:
                self._event_loop.run(self._async_engine.dispose())
            self._event_loop.close()
            self._event_loop = None

    def _finish_pending(self) -> None:
        """Wait for the batch in flight; store and commit its offsets; act on its failures."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        outcomes = pending.result()
        next_offsets, stops = merge_results(outcomes)
        self.metrics.applied.labels(self.effect.name).inc(sum(o.applied for o in outcomes))
        self.metrics.duplicates.labels(self.effect.name).inc(sum(o.duplicates for o in outcomes))
        failpoint("consumer.after_db_commit_before_offset_commit")
        self._store_offsets(next_offsets)
        self._commit(asynchronous=True)
        self.database_ok = all(f.kind != "database" for f in stops)
        for failure in stops:
            if failure.kind == "database":
                # Nothing of that lane was applied or committed: read it again.
                log.warning("database failed, re-reading from the failed record: %s", failure.error)
                self._seek(topic_partition(failure.message), failure.offset)
            else:
                self._handle_failure(failure)
        if not self.database_ok:
            time.sleep(1.0)

    # -- failures ---------------------------------------------------------------------------

    def _handle_failure(self, failure: Failure) -> None:
        message = failure.message
        tp = topic_partition(message)
        offset = failure.offset
        policy = self.effect.failure
        if failure.kind == "undecodable":
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

    def _dead_letter(self, failure: Failure, *, attempts: int, reason: str) -> None:
        message = failure.message
        tp = topic_partition(message)
        offset = failure.offset
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
        log.warning(
            "dead-lettered %s[%d]@%d to %s (%s): %s; to fix: %s",
            tp[0],
            tp[1],
            offset,
            self.effect.dlq_topic(tp[0]),
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
        self._store_offsets({tp: offset + 1})
        self._commit(asynchronous=True)
        self._seek(tp, offset + 1)

    def _pause(self, tp: PartitionId, offset: int, *, resume_at: float | None) -> None:
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

    def _seek(self, tp: PartitionId, offset: int) -> None:
        self._reset.add(tp)
        try:
            self._consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except KafkaException as exc:  # no longer assigned: the new owner starts from the commit
            log.info("seek skipped: %s", exc)

    # -- offsets ----------------------------------------------------------------------------

    def _store_offsets(self, next_offsets: dict[PartitionId, int]) -> None:
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


def dead_letter_fix(failure: Failure, *, effect: str) -> str:
    """How an operator repairs a dead-lettered record: the cause's fix, then the redrive."""
    tp = topic_partition(failure.message)
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


def _async_engine(engine: sa.Engine, lanes: int) -> AsyncEngine:
    """An asyncio engine on ``engine``'s database (psycopg 3's async driver), one connection
    per lane."""
    url = engine.url.set(drivername="postgresql+psycopg")
    return create_async_engine(url, pool_size=max(2, lanes), pool_pre_ping=True)


def split_lanes(records: Sequence[Record], lanes: int) -> list[list[Record]]:
    """``records`` shared over ``lanes`` runs by key (by partition for keyless records).

    A key always maps to the same lane, and each run keeps the batch's order.
    """
    runs: list[list[Record]] = [[] for _ in range(lanes)]
    for record in records:
        message = record.message
        key = message.key()
        basis = key if isinstance(key, bytes) else str(message.partition()).encode()
        runs[zlib.crc32(basis) % lanes].append(record)
    return [run for run in runs if run]


def merge_results(outcomes: Iterable[BatchResult]) -> tuple[dict[PartitionId, int], list[Failure]]:
    """The offsets to commit per partition, and the record each stopped partition stopped at.

    A partition's offset is the one after its last record done, unless a record of it failed in
    some lane: then it is the lowest failed record's offset (commit only below the lowest
    unfinished one), and that record's failure is the one the policy acts on.
    """
    next_offsets: dict[PartitionId, int] = {}
    stops: dict[PartitionId, Failure] = {}
    for outcome in outcomes:
        for tp, offset in outcome.done.items():
            next_offsets[tp] = max(next_offsets.get(tp, offset), offset)
        for failure in outcome.failures:
            tp = topic_partition(failure.message)
            if tp not in stops or failure.offset < stops[tp].offset:
                stops[tp] = failure
    for tp, failure in stops.items():
        next_offsets[tp] = failure.offset
    return next_offsets, list(stops.values())


def _names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]


def _ids(partitions: list[TopicPartition]) -> list[PartitionId]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _close_quietly(consumer: Consumer) -> None:
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as exc:
        log.info("closing the replaced Kafka consumer failed: %s", exc)
