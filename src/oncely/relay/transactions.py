"""Exactly-once producing: a Kafka transaction per page, on one producer per shard whose
transactional id follows the shard's lease, not the process.

The producer of shard ``n`` has the transactional id ``<prefix>-<n>``. Taking shards
(:meth:`Transactions.take`) calls ``init_transactions`` for each, which fences whichever
producer had that id before, even one whose process is only paused, and ends its open
transaction; then it reads the shards' last committed :class:`~oncely.wire.ProgressRecord`
back from :func:`~oncely.wire.progress_topic` with ``read_committed``. A page's records go into
its shard's open transaction (:meth:`Transactions.producer`); :meth:`Transactions.commit` adds
the page's progress record and commits on a worker thread, so the commits of several shards
overlap. Every report (each record's delivery report, and the commit's, whose message is
``None``) runs on the caller's thread, in :meth:`Transactions.poll`, and so does the
:class:`Ended` of each transaction, which :meth:`Transactions.ended` hands over.

A commit that fails with an error that needs an abort is aborted: none of its records is ever
visible to a ``read_committed`` consumer, and the page's report gets the error. A fenced or
fatal producer, or a commit that did not end in time, cannot say whether its transaction
committed: its shard is *lost* (:meth:`Transactions.lost`); the caller gives the lease up, and
the next owner's ``init_transactions`` settles the transaction and its progress record says
where it ended.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from oncely.failpoints import failpoint
from oncely.runtime.reach import KafkaReach
from oncely.wire import ProgressRecord, progress_topic, read_progress_record

log = logging.getLogger(__name__)

OnDelivery = Callable[[KafkaError | None, Message | None], None]

#: Errors of a producer fenced by another with its transactional id.
_FENCED = frozenset(
    (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
)


class Outcome(enum.Enum):
    """How a transaction ended."""

    COMMITTED = "committed"
    #: Aborted: a record of it failed, or its commit failed with an error that needs an abort.
    ABORTED = "aborted"
    #: Its producer was fenced: another one started with its transactional id (its shard is
    #: lost).
    FENCED = "fenced"
    #: Any other fatal error, or a commit or abort that did not end in time (its shard is lost).
    FAILED = "failed"

    @classmethod
    def of(cls, error: KafkaError | None) -> Outcome:
        """The outcome of a transaction whose shard was lost with ``error``."""
        return cls.FENCED if error is not None and error.code() in _FENCED else cls.FAILED


@dataclass(frozen=True, slots=True)
class Ended:
    """A transaction that ended: its shard, how, the seconds from ``begin_transaction`` to the
    end of its commit or abort, and the progress record committed with it (only when
    :attr:`Outcome.COMMITTED`)."""

    shard: int
    outcome: Outcome
    seconds: float
    progress: ProgressRecord | None = None


class Transactions:
    """The transactional producers of the shards held, and their commits."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        client: Mapping[str, Any],
        prefix: str,
        transaction_timeout_ms: int,
        timeout: float,
        workers: int = 32,
        reach: KafkaReach | None = None,
    ) -> None:
        """``config``: the producers' settings (the publisher's fixed ones among them,
        :data:`oncely.relay.publisher.REQUIRED`); ``client``: those every client shares (the
        progress read-back's consumer uses them); ``prefix``: of the transactional ids and the
        progress topic; ``transaction_timeout_ms``: how long the broker keeps a transaction
        open for a producer that went silent (the lease's length, so a dead owner's transaction
        holds its partitions' ``read_committed`` readers for about one lease); ``timeout``:
        seconds that ``init_transactions``, a commit and the read-back may take; ``reach``: the
        process's watch over its clients' outages (default: their own)."""
        self.prefix = prefix
        self.topic = progress_topic(prefix)
        self._config = {**config, "transaction.timeout.ms": transaction_timeout_ms}
        self._client = dict(client)
        self._reach = reach or KafkaReach()
        self._timeout = timeout
        self._producers: dict[int, Producer] = {}
        #: Each shard's last committed progress record (``None``: none yet), as this owner knows.
        self._last: dict[int, ProgressRecord | None] = {}
        #: The shards whose transaction is open, and when each began (monotonic).
        self._open: dict[int, float] = {}
        #: The shards whose transaction a worker is committing or aborting.
        self._ending: set[int] = set()
        self._ended: list[Ended] = []
        self._reports: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lost: set[int] = set()
        self._lost_lock = threading.Lock()
        #: Commits submitted whose report has not run yet.
        self.committing = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="oncely-commit")
        self._instances = itertools.count()
        #: The instance number of each shard's newest producer (its error callback's mark).
        self._instance: dict[int, int] = {}

    def transactional_id(self, shard: int) -> str:
        """The transactional id of ``shard``'s producer."""
        return f"{self.prefix}-{shard}"

    def take(self, shards: Iterable[int]) -> dict[int, ProgressRecord]:
        """Start the producers of ``shards`` (fencing their previous owners and ending their
        open transactions) and return the last committed progress record of each shard that
        has one.

        Raises ``KafkaException`` when a producer cannot start its transactions or the
        progress topic cannot be read within the timeout; the shards taken are then dropped.
        """
        numbers = list(shards)
        started = [self._pool.submit(self._start, shard) for shard in numbers]
        failed: KafkaException | None = None
        for shard, starting in zip(numbers, started, strict=True):
            try:
                self._producers[shard] = starting.result()
            except KafkaException as exc:
                failed = exc
        try:
            if failed is not None:
                raise failed
            found = self._read_back(set(numbers))
        except KafkaException:
            for shard in numbers:
                self.drop(shard)
            raise
        for shard in numbers:
            self._last[shard] = found.get(shard)
        return found

    def producer(self, shard: int) -> Producer:
        """The producer to send ``shard``'s records with, in its open transaction (begun here
        when none is). Give it reports wrapped by :meth:`report`."""
        producer = self._producers[shard]
        if shard not in self._open:
            try:
                producer.begin_transaction()
            except KafkaException as exc:
                self._lose(shard, exc.args[0])
                raise
            self._open[shard] = time.monotonic()
        return producer

    def report(self, report: OnDelivery) -> OnDelivery:
        """``report``, to run on the loop's thread (in :meth:`poll`) whichever thread the
        client calls it from."""
        return lambda error, message: self._reports.put(partial(report, error, message))

    def commit(
        self, shard: int, progress: ProgressRecord, report: OnDelivery, *, abort: bool = False
    ) -> None:
        """Add ``progress`` to ``shard``'s open transaction and commit it off this thread;
        ``report(None, None)`` once committed, ``report(error, None)`` when it was aborted or
        its shard was lost (then also in :meth:`lost`). With ``abort``, abort it instead
        (``report(None, None)`` once aborted)."""
        producer = self._producers[shard]
        self.committing += 1
        begun = self._open.pop(shard, None)
        if abort:
            if begun is not None:
                self._ending.add(shard)
                self._pool.submit(self._abort_page, shard, producer, begun, report)
            else:  # nothing was sent
                self._reports.put(partial(self._committed, report, None, None))
            return
        try:
            if begun is None:
                producer.begin_transaction()
                begun = time.monotonic()
            producer.produce(self.topic, progress.value(), progress.key())
        except KafkaException as exc:
            self._lose(shard, exc.args[0])
            ended = (
                Ended(shard, Outcome.of(exc.args[0]), time.monotonic() - begun)
                if begun is not None
                else None  # no transaction began
            )
            self._reports.put(partial(self._committed, report, ended, exc.args[0]))
            return
        self._ending.add(shard)
        self._pool.submit(self._commit, shard, producer, progress, begun, report)

    def _abort_page(self, shard: int, producer: Producer, begun: float, report: OnDelivery) -> None:
        ended, error = self._abort(shard, producer, begun)
        self._ending.discard(shard)
        self._reports.put(partial(self._committed, report, ended, error))

    def _committed(self, report: OnDelivery, ended: Ended | None, error: KafkaError | None) -> None:
        self.committing -= 1
        if ended is not None:
            self._ended.append(ended)
        report(error, None)

    def _commit(
        self,
        shard: int,
        producer: Producer,
        progress: ProgressRecord,
        begun: float,
        report: OnDelivery,
    ) -> None:
        error: KafkaError | None = None
        try:
            producer.flush(self._timeout)  # the records on the broker, then the commit
            failpoint("relay.before_commit")
            producer.commit_transaction(self._timeout)
            ended = Ended(shard, Outcome.COMMITTED, time.monotonic() - begun, progress)
            self._last[shard] = progress
        except KafkaException as exc:
            error = exc.args[0]
            if self._producers.get(shard) is not producer:
                # Replaced since (the shard was lost and taken again): only the page failed.
                ended = Ended(shard, Outcome.of(error), time.monotonic() - begun)
            elif error is not None and error.txn_requires_abort():
                ended, _ = self._abort(shard, producer, begun)
            else:
                self._lose(shard, error)
                ended = Ended(shard, Outcome.of(error), time.monotonic() - begun)
        self._ending.discard(shard)
        self._reports.put(partial(self._committed, report, ended, error))

    def _abort(
        self, shard: int, producer: Producer, begun: float
    ) -> tuple[Ended, KafkaError | None]:
        """Abort the shard's transaction (open since ``begun``) and start its producer again
        (after a record the broker refused, the old one's next transaction fails:
        ``OUT_OF_ORDER_SEQUENCE_NUMBER``, the refused batch left a gap in its sequence numbers);
        how the transaction ended, and the error when the producer could not go on.

        Starting a producer fences whoever else has its id, so the shard's progress is read
        back right after: when the last commit is not this relay's own (another relay took the
        shard over and published meanwhile), the shard is lost."""
        try:
            producer.abort_transaction(self._timeout)
        except KafkaException as exc:
            self._lose(shard, exc.args[0])
            return Ended(shard, Outcome.of(exc.args[0]), time.monotonic() - begun), exc.args[0]
        producer.poll(0)  # the reports of the records it purged, before the page's own
        aborted = Ended(shard, Outcome.ABORTED, time.monotonic() - begun)
        try:
            self._producers[shard] = self._start(shard)
            last = self._read_back({shard}).get(shard)
        except KafkaException as exc:
            self._lose(shard, exc.args[0])
            return aborted, exc.args[0]
        if last != self._last.get(shard):
            log.warning(
                "shard %d was published by another relay since this one's last commit: "
                "giving it up",
                shard,
            )
            self.lose(shard)
        return aborted, None

    def _start(self, shard: int) -> Producer:
        """A new producer of ``shard``'s transactional id, its transactions initialised."""
        instance = next(self._instances)
        self._instance[shard] = instance
        producer = Producer(
            self._reach.client_config(
                {
                    **self._config,
                    "transactional.id": self.transactional_id(shard),
                    "error_cb": partial(self._on_error, shard, instance),
                }
            )
        )
        producer.init_transactions(self._timeout)
        return producer

    def _on_error(self, shard: int, instance: int, error: KafkaError) -> None:
        # A producer replaced by a newer one of its shard (an abort starts one) is fenced by it:
        # that says nothing of the shard.
        if error.fatal() and self._instance.get(shard) == instance:
            self._lose(shard, error)

    def held(self) -> list[int]:
        """The shards whose producers are started."""
        return list(self._producers)

    def lose(self, shard: int) -> None:
        """Give ``shard`` up (it shows in :meth:`lost`): its producer cannot go on."""
        with self._lost_lock:
            self._lost.add(shard)

    def _lose(self, shard: int, error: KafkaError | None) -> None:
        log.error(
            "the transactional producer of shard %d cannot go on: %s",
            shard,
            error.str() if error is not None else "unknown error",
            extra={"code": error.name() if error is not None else None},
        )
        self.lose(shard)

    def lost(self) -> set[int]:
        """The shards whose producer was fenced or failed fatally since the last call: give
        their leases up and :meth:`drop` them."""
        with self._lost_lock:
            lost, self._lost = self._lost, set()
        return lost

    def ended(self) -> list[Ended]:
        """The transactions whose reports ran (in :meth:`poll`) since the last call, in order."""
        ended, self._ended = self._ended, []
        return ended

    def poll(self, timeout: float) -> None:
        """Run the reports that arrived, waiting up to ``timeout`` seconds for a first one (the
        producers of open transactions are served first: their reports arrive)."""
        for shard in self._open:
            self._producers[shard].poll(0)
        try:
            self._reports.get(timeout=timeout)()
        except queue.Empty:
            return
        while True:
            try:
                self._reports.get_nowait()()
            except queue.Empty:
                return

    def wait(self, timeout: float) -> int:
        """Run reports until every commit submitted has reported, for at most ``timeout``
        seconds; return how many have not."""
        deadline = time.monotonic() + timeout
        while self.committing and time.monotonic() < deadline:
            self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.committing

    def drop(self, shard: int) -> None:
        """Stop producing for ``shard``: its open transaction is left to the broker's timeout
        or to the next owner's ``init_transactions``."""
        producer = self._producers.pop(shard, None)
        self._instance.pop(shard, None)
        self._open.pop(shard, None)
        self._last.pop(shard, None)
        if producer is not None:
            producer.purge()

    def close(self) -> None:
        """Wait for the commits under way, then drop every producer."""
        self._pool.shutdown(wait=True)
        for shard in list(self._producers):
            self.drop(shard)

    def _read_back(self, shards: set[int]) -> dict[int, ProgressRecord]:
        """The last committed progress record of each of ``shards``: read with
        ``read_committed`` up to the partition's high watermark when the read starts.

        Not only to its end as ``read_committed`` sees it (the last stable offset): the shards'
        transactions share the partition, and one left open by another producer (a crashed
        owner's, until the broker aborts it) would end that read early, before a later commit
        of ``shards``. Their own producers were started before the read, so every commit of
        theirs is below that watermark."""
        found: dict[int, ProgressRecord] = {}
        if not shards:
            return found
        deadline = time.monotonic() + self._timeout
        partition = TopicPartition(self.topic, 0, OFFSET_BEGINNING)
        high = self._high_watermark(partition)
        consumer = self._consumer("read_committed")
        try:
            consumer.assign([partition])
            at = 0
            while at < high:
                message = consumer.poll(max(0.0, deadline - time.monotonic()))
                if message is None or time.monotonic() > deadline:
                    raise KafkaException(
                        KafkaError(
                            KafkaError._TIMED_OUT,
                            f"{self.topic} read to offset {at} of {high} in {self._timeout} s: "
                            f"a transaction on it stays open ({self._opened_at(at)})",
                        )
                    )
                error = message.error()
                at = message.offset() or at
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(error)
                    continue
                at += 1
                value = message.value()
                if value is None:
                    continue
                try:
                    record = read_progress_record(value)
                except ValueError as exc:  # the database's position stands: never loss
                    log.warning("skipped a record of %s: %s", self.topic, exc)
                    continue
                if record.shard in shards:
                    found[record.shard] = record
        finally:
            consumer.close()
        return found

    def _high_watermark(self, partition: TopicPartition) -> int:
        """The partition's high watermark (a ``read_committed`` client asks for the last stable
        offset instead)."""
        consumer = self._consumer("read_uncommitted")
        try:
            _, high = consumer.get_watermark_offsets(partition, self._timeout, cached=False)
        finally:
            consumer.close()
        return int(high)

    def _opened_at(self, offset: int) -> str:
        """Whose is the record at ``offset`` (the first of a transaction left open), for the
        error that names it. When it is a shard whose producer is this relay's, with no
        transaction open or ending, the broker left that transaction hanging: a healthy broker
        ends a transaction once its producer commits, aborts or is fenced."""
        consumer = self._consumer("read_uncommitted")
        try:
            consumer.assign([TopicPartition(self.topic, 0, offset)])
            message = consumer.poll(2.0)
        finally:
            consumer.close()
        key = None if message is None or message.error() is not None else message.key()
        if key is None:
            return "its first record unread"
        shard = key.decode(errors="replace") if isinstance(key, bytes) else key
        whose = f"shard {shard}'s, from offset {offset}"
        number = int(shard) if shard.isdigit() else None
        ending = number in self._open or number in self._ending
        if number in self._producers and not ending:
            return (
                f"{whose}, though this relay's producer of the shard has no transaction open: "
                "the broker left it hanging, see docs/how-to/deploy.md#a-hanging-transaction"
            )
        return whose

    def _consumer(self, isolation: str) -> Consumer:
        return Consumer(
            self._reach.client_config(
                {
                    **self._client,
                    "group.id": f"{self.prefix}-read-back",
                    "enable.auto.commit": False,
                    "isolation.level": isolation,
                    "enable.partition.eof": True,
                }
            )
        )
