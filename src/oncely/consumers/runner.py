"""The consumer loop of one effect: poll records, apply each once, commit the DB, then the offsets.

Records are applied by :class:`~oncely.consumers.apply.Applier` in database transactions
(receipts and effects together); only then are their offsets stored and committed. A crash
anywhere before the offset commit redelivers records whose receipts already exist: they are
counted as duplicates and not applied again.

With one lane (the default) and for ``async`` effects, each polled batch is applied in one
transaction per lane on a thread of its own while the loop fetches and reads the next one (one
batch in flight): offsets are stored and committed batch after batch, each after its batch's
commit. A fetch never waits out a timeout while records are there: it takes what is buffered,
and only when nothing is does it wait for the first record, then takes the rest that arrived
with it. An ``async`` effect's batches run on an asyncio event loop on that thread, its lanes
(``lanes`` > 1, :mod:`.lanes`) as concurrent tasks: the next batch waits for the slowest.

A sync effect with ``lanes`` > 1 has lanes that keep taking work (:mod:`.workers`): the loop
splits what it fetches by key onto each lane's queue, up to two batches of records in flight
(at the bound it stops fetching and waits for a lane), and a lane applies what its queue holds
in one transaction. A partition commits the contiguous prefix of records every lane has
finished (:mod:`.commit_points`), so its committed offset never passes a record not applied,
while a slow key holds back only its own lane; records of other keys after it that were applied
are read again after a crash and suppressed by their receipts. Offsets are committed at most
every 0.2 s this way, and at once on a rebalance and at shutdown.

A failing record stops its partition (in its lane), and the committed offset stops just before
it; then the effect's failure policy acts (:mod:`.failures`: retry in place, dead-letter or
block), through the partition gate (:mod:`.gate`), and a database failure reads the partition
again from the failed record. Nothing is skipped silently. With lanes, ``block`` stops the
partition at the failing record, but records of other keys after it (up to what was in flight)
may already have been applied.

On a rebalance the partitions revoked finish what is being applied (lanes skip what they have
not started), commit, and only then are let go; partitions lost are dropped without a commit.
At shutdown the same happens for every partition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from oncely.consumers.apply import (
    Applier,
    BatchResult,
    Failure,
    PartitionId,
    Record,
    topic_partition,
)
from oncely.consumers.dlq import DeadLetters
from oncely.consumers.effects import Effect
from oncely.consumers.failures import FailureHandling
from oncely.consumers.gate import PartitionGate
from oncely.consumers.lanes import Lanes, async_engine, merge_results
from oncely.consumers.membership import Membership
from oncely.consumers.records import read_envelope
from oncely.consumers.workers import LaneWorkers
from oncely.failpoints import failpoint
from oncely.runtime.metrics import ConsumerMetrics
from oncely.runtime.process import Every
from oncely.runtime.reach import KafkaReach
from oncely.runtime.tracing import Tracing
from oncely.schemas.codec import Codec
from oncely.security import AuthWatch
from oncely.settings import ConsumerSettings, KafkaSettings

log = logging.getLogger(__name__)

_LAG_INTERVAL = 5.0
#: How long a fetch waits while lanes are busy, so that their reports are collected soon.
_FEED_WAIT = 0.02
#: Lanes that keep taking work commit their offsets at most this often (and on each rebalance
#: and at shutdown).
_COMMIT_INTERVAL = 0.2
#: Records the lanes may hold (queued or applying), in batches: the fetch stops at it.
_IN_FLIGHT_BATCHES = 2


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
        tracing: Tracing | None = None,
        reach: KafkaReach | None = None,
    ) -> None:
        """``tracing`` records the handlers' spans (default: the global tracer provider);
        ``reach``: the process's watch over its clients' outages (default: the consumer's
        own)."""
        self.effect = effect
        self.group_id = group_id
        self.settings = settings
        self.metrics = metrics
        self.dead_letters = dead_letters
        self._types_by_topic = {t.topic: t for t in effect.event_types}
        self._auth = AuthWatch()  # refused credentials stop the consumer (retrying cannot help)
        self._config = (reach or KafkaReach()).client_config(
            {**consumer_config(kafka, settings, group_id), "error_cb": self._auth}
        )
        self._consumer = Consumer(self._config)
        # Lanes that keep taking work (sync effects with lanes > 1), or batch after batch.
        self._workers: LaneWorkers | None = None
        self._lanes: Lanes | None = None
        applier = Applier(
            effect,
            engine,
            metrics,
            codec,
            async_engine(engine, settings.lanes) if effect.is_async else None,
            group_id=group_id,
            tracing=tracing,
        )
        if settings.lanes > 1 and not effect.is_async:
            self._workers = LaneWorkers(
                applier,
                settings.lanes,
                run_size=settings.batch_size,
                bound=_IN_FLIGHT_BATCHES * settings.batch_size,
            )
        else:
            self._lanes = Lanes(applier, settings.lanes)
        self._commit_every = Every(_COMMIT_INTERVAL)
        self._uncommitted = False
        self._apply_thread = ThreadPoolExecutor(1, thread_name_prefix=f"apply-{effect.name}")
        self._pending: Future[list[BatchResult]] | None = None
        self._gate = PartitionGate(lambda: self._consumer)
        self._failures = FailureHandling(
            effect, metrics, dead_letters, self._gate, commit_past=self._commit_past, engine=engine
        )
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
        lag = Every(_LAG_INTERVAL)
        try:
            while not stop.is_set():
                self.heartbeat = now = time.monotonic()
                self._watch_membership(now)
                self._gate.resume_due(now)
                self._gate.fetching()
                if self._workers is not None:
                    self._feed(self._workers)
                else:
                    self._batch()
                if lag.due():
                    self._update_lag()
                    self.dead_letters.poll()
        finally:
            try:
                self._finish_pending()
                self._settle_lanes(None)
                self._commit(asynchronous=False)
                self._consumer.close()
            finally:
                if self._workers is not None:
                    self._workers.close()
                if self._lanes is not None:
                    self._apply_thread.submit(self._lanes.close).result()
                self._apply_thread.shutdown()

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
        self._gate.assigned(_ids(partitions))
        self.membership.assigned(_ids(partitions), time.monotonic())
        log.info(
            "partitions assigned",
            extra={"effect": self.effect.name, "partitions": _names(partitions)},
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Finish the batch in flight (the lanes' runs started on these partitions; what they
        # have not started is skipped), then commit everything applied before letting go.
        self._finish_pending()
        self._settle_lanes(_ids(partitions))
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
        if self._workers is not None:
            self._workers.cancel(_ids(partitions))
            self._workers.forget(_ids(partitions))
        self._gate.forget(_ids(partitions))
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
        if self._workers is not None:
            self._settle_lanes(None)
            self._workers.forget(self._workers.partitions())
        stale = self._consumer
        self._consumer = Consumer(self._config)
        self._gate.clear()
        self.membership.restarted(now)
        self.metrics.rejoins.labels(self.effect.name).inc()
        self._subscribe()
        threading.Thread(
            target=_close_quietly, args=(stale,), name=f"close-{self.effect.name}", daemon=True
        ).start()

    # -- one batch at a time ----------------------------------------------------------------

    def _batch(self) -> None:
        """Fetch the next batch while the one in flight applies; then finish that one and hand
        this one to the apply thread."""
        assert self._lanes is not None
        messages = self._fetch(0.0 if self._pending else self.settings.poll_timeout_seconds)
        self._auth.check()
        records = self._read(messages)
        self._finish_pending()
        # Records read before their partition was sought, paused or let go are dropped.
        records = self._gate.admitted(records)
        if records:
            failpoint("consumer.after_poll")
            self.metrics.consumed.labels(self.effect.name).inc(len(records))
            self._pending = self._apply_thread.submit(self._lanes.apply, records)

    # -- lanes that keep taking work --------------------------------------------------------

    def _feed(self, workers: LaneWorkers) -> None:
        """Fetch as much as the lanes have room for, act on their reports, hand them the
        records; with no room, wait for a report instead of fetching."""
        room = min(workers.room(), self.settings.batch_size)
        messages: list[Message] = []
        if room > 0:
            busy = workers.in_flight > 0
            messages = self._fetch(_FEED_WAIT if busy else self.settings.poll_timeout_seconds, room)
        self._auth.check()
        records = self._read(messages)
        self._collect(workers, wait=0.0 if room > 0 else self.settings.poll_timeout_seconds)
        # Records read before their partition was sought, paused or let go are dropped.
        records = self._gate.admitted(records)
        if records:
            failpoint("consumer.after_poll")
            self.metrics.consumed.labels(self.effect.name).inc(len(records))
            workers.submit(records)
        if self._uncommitted and self._commit_every.due():
            self._commit(asynchronous=True)

    def _collect(self, workers: LaneWorkers, *, wait: float) -> None:
        """Store the offsets the lanes' reports finished; act on their failures."""
        collected = workers.collect(wait)
        if collected.applied:
            self.metrics.applied.labels(self.effect.name).inc(collected.applied)
        if collected.duplicates:
            self.metrics.duplicates.labels(self.effect.name).inc(collected.duplicates)
        if collected.commit:
            failpoint("consumer.after_db_commit_before_offset_commit")
            self._store_offsets(collected.commit)
            self._uncommitted = True
        if collected.reported:
            self._act_on(collected.failures)

    def _settle_lanes(self, tps: list[PartitionId] | None) -> None:
        """Let the lanes finish the runs they started (skipping what they have not started of
        ``tps``, or of every partition) and store what they finished."""
        if self._workers is None:
            return
        self._workers.cancel(self._workers.partitions() if tps is None else tps)
        self._workers.settle()
        self._collect(self._workers, wait=0.0)

    # -- either way -------------------------------------------------------------------------

    def _fetch(self, wait: float, limit: int | None = None) -> list[Message]:
        """Up to ``limit`` (``batch_size``) records: those already buffered, else (when
        ``wait`` > 0) the first to arrive within ``wait`` seconds and those that came with it."""
        size = limit or self.settings.batch_size
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
            if not self._gate.is_paused(topic_partition(message)):
                records.append(read_envelope(message, types_by_topic=self._types_by_topic))
        return records

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
        self._act_on(stops)

    def _act_on(self, stops: list[Failure]) -> None:
        """Seek back to a record the database failed; apply the policy to the others."""
        self.database_ok = all(f.kind != "database" for f in stops)
        for failure in stops:
            if failure.kind == "database":
                # Nothing of that lane was applied or committed: read it again.
                log.warning("database failed, re-reading from the failed record: %s", failure.error)
                self._gate.seek(failure.partition_id, failure.offset)
            else:
                self._failures.handle(failure)
        if not self.database_ok:
            time.sleep(1.0)

    # -- offsets ----------------------------------------------------------------------------

    def _store_offsets(self, next_offsets: dict[PartitionId, int]) -> None:
        if next_offsets:
            try:
                self._consumer.store_offsets(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in next_offsets.items()]
                )
            except KafkaException as exc:  # revoked meanwhile: redelivery is absorbed
                log.info("offsets not stored: %s", exc)

    def _commit_past(self, tp: PartitionId, offset: int) -> None:
        """Commit ``tp`` past a dead letter; with lanes that keep taking work, only as far as
        every record below ``offset`` is finished."""
        if self._workers is not None:
            self._store_offsets(self._workers.skip_to(tp, offset))
        else:
            self._store_offsets({tp: offset})
        self._commit(asynchronous=True)

    def _commit(self, *, asynchronous: bool) -> None:
        self._uncommitted = False
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


def _names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]


def _ids(partitions: list[TopicPartition]) -> list[PartitionId]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _close_quietly(consumer: Consumer) -> None:
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as exc:
        log.info("closing the replaced Kafka consumer failed: %s", exc)
