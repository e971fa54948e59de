"""The relay's Kafka producer: idempotent, ``acks=all``, Java-compatible partitioning.

Each row's result arrives through its delivery report, the only truth about whether the broker
has the record. ``BufferError`` (the local queue is full) is backpressure: serve reports and
try again. A fatal error of the idempotent producer is remembered in :attr:`Publisher.fatal`;
the relay then calls :meth:`Publisher.recreate`, which fails every outstanding record (they
retry) and starts a new producer. Refused credentials are remembered in
:attr:`Publisher.auth_failed`: librdkafka would retry them forever, so the relay stops instead
(:class:`~oncely.security.KafkaAuthenticationError`).

A row staged with a trace context is produced inside a PRODUCER span when the process records
spans (:meth:`~oncely.runtime.tracing.Tracing.send`): the span is the active one while the
record is handed over (an instrumented client's own span is its child), and the record's
headers are then given as a mapping, so such a client replaces the ``traceparent`` instead of
adding a second one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from uuid import UUID

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from oncely.relay.topics import TopicState, topic_error_state
from oncely.relay.transactions import Ended, Transactions
from oncely.runtime.reach import KafkaReach
from oncely.runtime.tracing import Tracing
from oncely.security import KafkaAuthenticationError, is_authentication_failure
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
from oncely.wire import ProgressRecord, check_cloudevents_source, trace_context_fields

log = logging.getLogger(__name__)

OnDelivery = Callable[[KafkaError | None, Message | None], None]

#: How long a topic's ``max.message.bytes`` is kept before the broker is asked again (seconds).
_LIMITS_TTL = 60.0


def position(record: ProgressRecord) -> Progress:
    """The position a progress record of :func:`~oncely.wire.progress_topic` holds."""
    return Progress(
        Snapshot.parse(record.done),
        Snapshot.parse(record.reading) if record.reading is not None else None,
        record.after_seq,
    )


#: Settings the relay's guarantees depend on; configuration cannot override them.
REQUIRED = {
    "enable.idempotence": True,
    "acks": "all",
    "partitioner": "murmur2_random",
}


class Publisher:
    """Produce outbox rows; each one's result goes to the report given with it."""

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        client: Mapping[str, Any],
        cloudevents_source: str | None = None,
        tracing: Tracing | None = None,
        reach: KafkaReach | None = None,
    ) -> None:
        """``config``: the producer's settings; ``client``: those any client shares (an admin
        client reads topic limits with them); ``cloudevents_source``: add the CloudEvents
        headers with this ``ce_source`` (:func:`oncely.wire.cloudevents_headers`);
        ``tracing``: who records the PRODUCER spans (default: the global tracer provider);
        ``reach``: the process's watch over its clients' outages (default: the publisher's own).

        Raises ``ValueError`` when ``cloudevents_source`` is not a URI-reference.
        """
        self._cloudevents_source = (
            check_cloudevents_source(cloudevents_source) if cloudevents_source is not None else None
        )
        self._tracing = tracing or Tracing()
        self._reach = reach or KafkaReach()
        self._config = self._reach.client_config({**config, **REQUIRED, "error_cb": self._on_error})
        self._admin = AdminClient(self._reach.client_config(client))
        self._limits: dict[str, tuple[int | None, float]] = {}
        self.fatal: KafkaError | None = None
        #: The broker refused the credentials (``_AUTHENTICATION``): retrying will not help.
        self.auth_failed: KafkaError | None = None
        self._producer = Producer(self._config)

    def check_credentials(self, *, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the broker's metadata, to find refused credentials.

        Call it before producing. Raises :class:`~oncely.security.KafkaAuthenticationError`
        when the broker refuses the credentials. Returns when metadata arrived, and also when
        no broker can be reached (an outage, which the relay rides out) or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._producer.list_topics(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                return
            except KafkaException:
                self._producer.poll(0)  # serves error_cb
            if self.auth_failed is not None:
                raise KafkaAuthenticationError.of(self.auth_failed)
            if self.brokers_down or time.monotonic() >= deadline:
                return

    def _on_error(self, error: KafkaError) -> None:
        if is_authentication_failure(error):
            if self.auth_failed is None:  # librdkafka repeats it on every reconnect
                self.auth_failed = error
                log.error(
                    "Kafka refused the credentials: %s (check ONCELY_KAFKA_SASL_USERNAME and "
                    "ONCELY_KAFKA_SASL_PASSWORD)",
                    error.str(),
                    extra={"code": error.name()},
                )
        elif error.fatal():
            self.fatal = error
            log.error("fatal producer error: %s", error.str(), extra={"code": error.name()})
        else:
            log.warning("producer error: %s", error.str(), extra={"code": error.name()})

    def produce(self, row: OutboxRow, report: OnDelivery) -> KafkaError | None:
        """Hand ``row`` to the producer; its result comes later, to ``report``, from a poll.

        Returns the error when the client refuses the record at once (larger than
        ``message.max.bytes``); ``report`` is then never called.
        """
        if row.trace_context is None:
            headers = row.kafka_headers(trace=(), cloudevents_source=self._cloudevents_source)
            return self._produce(row, headers, report)
        staged = trace_context_fields(row.trace_context)
        sending = (
            self._tracing.send(
                topic=row.topic, event_id=row.event_id, key=row.aggregateid, staged=staged
            )
            if staged
            else None
        )
        fields = sending.fields if sending is not None else staged
        trace = tuple((name, value.encode()) for name, value in fields.items())
        headers = row.kafka_headers(trace=trace, cloudevents_source=self._cloudevents_source)
        if sending is None:
            return self._produce(row, headers, report)
        with sending.current():
            refused = self._produce(row, dict(headers), sending.reported(report))
        if refused is not None:
            sending.refused(refused)
        return refused

    def _produce(
        self,
        row: OutboxRow,
        headers: list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None],
        report: OnDelivery,
    ) -> KafkaError | None:
        try:
            producer, report = self._sender(row, report)
        except KafkaException as exc:
            sender_error: KafkaError = exc.args[0]
            return sender_error
        while True:
            try:
                producer.produce(
                    row.topic,
                    row.payload,
                    row.key,
                    headers=headers,
                    timestamp=row.timestamp_ms,
                    on_delivery=report,
                )
                return None
            except BufferError:
                producer.poll(0.1)
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                return error

    def _sender(self, row: OutboxRow, report: OnDelivery) -> tuple[Producer, OnDelivery]:
        """The producer that sends ``row``, and the report to give it."""
        return self._producer, report

    @property
    def brokers_down(self) -> bool:
        """Every broker is down, as the process's clients see it (:class:`KafkaReach`)."""
        return self._reach.down

    def reachable(self) -> None:
        """A record was acknowledged: a broker answered (:meth:`KafkaReach.reached`)."""
        self._reach.reached()

    def topic_state(self, topic: str, *, timeout: float = 2.0) -> TopicState:
        """Whether the broker has ``topic`` and lets this client describe it, from its metadata
        (waiting at most ``timeout`` seconds; no answer is :attr:`TopicState.UNKNOWN`).

        Asking does not create the topic unless the broker creates topics on demand.
        """
        try:
            metadata = self._producer.list_topics(topic=topic, timeout=timeout)
        except KafkaException:
            return TopicState.UNKNOWN
        found = metadata.topics.get(topic)
        if found is None:
            return TopicState.UNKNOWN
        if found.error is None or found.error.code() == KafkaError.LEADER_NOT_AVAILABLE:
            return TopicState.EXISTS
        return topic_error_state(found.error) or TopicState.UNKNOWN

    def max_message_bytes(self, topic: str) -> int | None:
        """The topic's ``max.message.bytes`` (cached for ``_LIMITS_TTL`` seconds), or ``None``
        if unknown.

        Asks the broker at most once per ``_LIMITS_TTL`` per topic, waiting at most about 2 s
        (the loop waits meanwhile); an unanswered question keeps the last known value.
        """
        cached = self._limits.get(topic)
        now = time.monotonic()
        if cached is not None and now - cached[1] < _LIMITS_TTL:
            return cached[0]
        limit: int | None = None
        try:
            resource = ConfigResource(ResourceType.TOPIC, topic)
            configs = self._admin.describe_configs([resource], request_timeout=1)[resource]
            limit = int(configs.result(timeout=2)["max.message.bytes"].value)
        except (KafkaException, KeyError, ValueError, TypeError, concurrent.futures.TimeoutError):
            limit = cached[0] if cached is not None else None
        self._limits[topic] = (limit, now)
        return limit

    def forget_limits(self, topic: str) -> None:
        """Read the topic's limits again next time (the broker refused a record)."""
        self._limits.pop(topic, None)

    def poll(self, timeout: float) -> None:
        """Serve delivery reports (and both clients' log lines) for up to ``timeout`` seconds."""
        self._producer.poll(timeout)
        self._admin.poll(0)

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every report; return how many are still missing."""
        return int(self._producer.flush(timeout))

    def recreate(self) -> None:
        """Fail every outstanding record (reported as purged) and start a new producer.

        Only for a producer that cannot go on (a fatal error, or every broker gone past the
        delivery timeout). Records already sent may still land: the relay replays them, as
        duplicates in order.
        """
        self._producer.purge()
        self._producer.flush(0)
        self._producer = Producer(self._config)
        self.fatal = None

    def take(self, shards: Iterable[int]) -> dict[int, Progress]:
        """Ready to publish ``shards``' rows, just leased; the position Kafka holds for each
        shard that has one (none here: progress lives in the database only)."""
        return {}

    def commit(
        self,
        progress: ShardProgress,
        report: OnDelivery,
        *,
        abort: bool = False,
        releasing: Iterable[UUID] = (),
    ) -> bool:
        """End the page of ``progress.shard`` that reaches ``progress`` (``abort``: a row of it
        failed, none may show; ``releasing``: the parked rows whose keys' rows it holds); whether
        it had to be committed, then ``report`` gets the result. Here each record's delivery
        report is the page's whole result: ``False``."""
        return False

    def released(self, shard: int) -> frozenset[UUID]:
        """The parked rows of ``shard`` whose keys' rows a committed transaction published and
        whose unparking is not recorded yet (:meth:`unparked`): none here, where a release is
        published again until it is recorded."""
        return frozenset()

    def unparked(self, shard: int, parked: UUID) -> None:
        """PostgreSQL recorded the unparking of ``parked``'s key (or no longer has it)."""

    def lost(self) -> set[int]:
        """The shards this publisher can no longer publish for (none here)."""
        return set()

    def ended(self) -> Sequence[Ended]:
        """The transactions that ended since the last call (none here)."""
        return ()

    def drop(self, shard: int) -> None:
        """The shard is no longer held."""


class TransactionalPublisher(Publisher):
    """A :class:`Publisher` whose rows go out in Kafka transactions, one per page, on their
    shard's transactional producer (:mod:`oncely.relay.transactions`): a ``read_committed``
    consumer sees a page's records only once its progress record is committed with them.

    Rows are sent only for shards taken (:meth:`take`). Each record's report, and each
    commit's, run on the thread that calls :meth:`poll` or :meth:`flush`.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        client: Mapping[str, Any],
        transactions: Transactions,
        cloudevents_source: str | None = None,
        tracing: Tracing | None = None,
        reach: KafkaReach | None = None,
    ) -> None:
        """As :class:`Publisher`; ``transactions``: the shards' producers (its own producer
        only answers questions about topics)."""
        super().__init__(
            config,
            client=client,
            cloudevents_source=cloudevents_source,
            tracing=tracing,
            reach=reach,
        )
        self._transactions = transactions
        #: Per shard, what :meth:`released` answers.
        self._released: dict[int, set[UUID]] = {}

    def _sender(self, row: OutboxRow, report: OnDelivery) -> tuple[Producer, OnDelivery]:
        return self._transactions.producer(row.shard), self._transactions.report(report)

    def take(self, shards: Iterable[int]) -> dict[int, Progress]:
        """Start the shards' transactional producers, fencing their previous owners, and
        return the position of each shard's last committed transaction.

        Raises ``KafkaException`` when the producers cannot start or the positions cannot be
        read (nothing is taken).
        """
        numbers = list(shards)
        records = self._transactions.take(numbers)
        for shard in numbers:
            record = records.get(shard)
            self._released[shard] = {UUID(i) for i in record.released} if record else set()
        return {shard: position(record) for shard, record in records.items()}

    def commit(
        self,
        progress: ShardProgress,
        report: OnDelivery,
        *,
        abort: bool = False,
        releasing: Iterable[UUID] = (),
    ) -> bool:
        """As :meth:`Publisher.commit`; the progress record carries ``releasing`` and every
        release of the shard committed and not yet :meth:`unparked`."""
        position = progress.progress
        shard = progress.shard
        adding = set(releasing)
        carried = self._released.setdefault(shard, set())
        record = ProgressRecord(
            shard,
            progress.epoch,
            str(position.done),
            str(position.reading) if position.reading is not None else None,
            position.after_seq,
            tuple(sorted(str(i) for i in carried | adding)),
        )

        def ended(error: KafkaError | None, message: Message | None) -> None:
            if error is None and not abort:
                carried.update(adding)
            report(error, message)

        self._transactions.commit(shard, record, ended if adding else report, abort=abort)
        return True

    def released(self, shard: int) -> frozenset[UUID]:
        return frozenset(self._released.get(shard, ()))

    def unparked(self, shard: int, parked: UUID) -> None:
        self._released.get(shard, set()).discard(parked)

    def lost(self) -> set[int]:
        return self._transactions.lost()

    def ended(self) -> Sequence[Ended]:
        return self._transactions.ended()

    def drop(self, shard: int) -> None:
        self._released.pop(shard, None)
        self._transactions.drop(shard)

    def poll(self, timeout: float) -> None:
        super().poll(0)
        self._transactions.poll(timeout)

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every commit under way; return how many have not
        reported."""
        return self._transactions.wait(timeout)

    def recreate(self) -> None:
        """Every shard is lost: its transaction's outcome is unknown until a new owner's
        ``init_transactions`` settles it."""
        for shard in self._transactions.held():
            self._transactions.lose(shard)
        self.fatal = None
