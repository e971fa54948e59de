"""``oncely verify``: reconcile one time window across the outbox, Kafka and the receipts.

For the outbox rows created in ``[since, until)`` (committed rows only: the check reads one
REPEATABLE READ, READ ONLY snapshot, on the database clock), :func:`verify_window` reports:

- **stuck**: rows still pending or dead longer than ``max_pending_age`` after their creation;
- **lost**: published rows whose Kafka record is not at the stored partition and offset, or
  carries another ``id`` header. Rows are streamed in (topic, partition, offset) order from a
  server-side cursor against one consumer reading each partition forward (seeking over gaps),
  so memory stays bounded whatever the window's size;
- **not applied**, per effect: published rows of the event types the effect consumes without
  its receipt. The receipts' primary key ``(event_id, effect)`` makes a second receipt
  impossible, and a receipt of an event outside the window is no concern of this check;
- **out of order**, per effect: an event applied (receipt ``applied_at``) before the previous
  event of its key in ``seq`` order. Kafka orders a key within its topic's partition only, so
  keys are compared within a topic.

The receipt and order checks run in SQL. Limits: only rows still in ``oncely_outbox`` can be
checked (the relay purges published rows after its retention, or deletes them at once with
retention 0); a published record below its partition's log start offset (deleted, or past the
topic's retention) counts as lost; and the window should end a little in the past so that
consumers have applied what was just published.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from itertools import groupby
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from oncely.consumers.effects import Effect
from oncely.errors import OncelyError
from oncely.storage.queries import query

#: Rows fetched per round trip from the server-side cursor.
_CURSOR_ROWS = 2000
#: Records fetched per consume() call.
_FETCH = 2000
#: Re-position the consumer instead of reading through a gap wider than this many offsets.
_SEEK_GAP = 5000
#: Report progress every this many checked rows.
_PROGRESS_EVERY = 1000

PURGED_NOTE = (
    "only rows still in oncely_outbox are checked: rows the relay purged after publishing "
    "(retention, or deleted at once with retention 0) cannot be verified"
)


class VerifyError(OncelyError):
    """The verification could not run."""


@dataclass(frozen=True, slots=True)
class OutboxSummary:
    """The window's rows by state; ``unlocated``: published rows without a stored offset."""

    committed: int
    published: int
    pending: int
    dead: int
    skipped: int
    stuck: int
    unlocated: int
    oldest_unpublished_seconds: float | None


@dataclass(frozen=True, slots=True)
class StuckRow:
    id: UUID
    topic: str
    aggregateid: str
    status: str
    attempts: int
    age_seconds: float
    last_error: str | None


@dataclass(frozen=True, slots=True)
class LostRecord:
    """A published row whose record is not in Kafka as stored.

    ``reason``: ``topic_missing``, ``partition_missing``, ``deleted`` (below the partition's log
    start offset), ``missing`` (no record at that offset) or ``id_mismatch`` (``found_id`` is
    the record's ``id`` header, ``None`` when it has none).
    """

    id: UUID
    topic: str
    partition: int
    offset: int
    reason: str
    found_id: str | None = None


@dataclass(frozen=True, slots=True)
class OutOfOrder:
    """``id`` was applied before ``previous_id``, the earlier event of its key."""

    id: UUID
    previous_id: UUID


@dataclass(frozen=True, slots=True)
class EffectVerdict:
    """One effect over the window: ``expected`` published events of its types, ``applied``."""

    effect: str
    event_types: list[str]
    expected: int
    applied: int
    out_of_order: int
    not_applied_ids: list[UUID]
    out_of_order_ids: list[OutOfOrder]

    @property
    def not_applied(self) -> int:
        return self.expected - self.applied


@dataclass(frozen=True, slots=True)
class Report:
    """The verdict; id lists hold at most the ``limit`` first offenders, counts are complete."""

    database: str
    since: datetime
    until: datetime
    max_pending_age_seconds: float
    outbox: OutboxSummary
    checked: int
    lost: int
    lost_records: list[LostRecord]
    stuck_rows: list[StuckRow]
    effects: list[EffectVerdict]
    notes: list[str]

    @property
    def problems(self) -> dict[str, int]:
        """Counts of what makes the verification fail."""
        return {
            "lost": self.lost,
            "not_applied": sum(e.not_applied for e in self.effects),
            "out_of_order": sum(e.out_of_order for e in self.effects),
            "stuck": self.outbox.stuck,
        }

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def to_json(self) -> dict[str, Any]:
        """The ``oncely verify --json`` document (ids as strings, times in ISO-8601)."""
        return {
            "database": self.database,
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "max_pending_age_seconds": self.max_pending_age_seconds,
            "outbox": asdict(self.outbox),
            "kafka": {"checked": self.checked, "lost": self.lost},
            "effects": [
                {
                    "effect": e.effect,
                    "event_types": e.event_types,
                    "expected": e.expected,
                    "applied": e.applied,
                    "not_applied": e.not_applied,
                    "out_of_order": e.out_of_order,
                    "not_applied_ids": [str(i) for i in e.not_applied_ids],
                    "out_of_order_ids": [
                        {"id": str(o.id), "previous_id": str(o.previous_id)}
                        for o in e.out_of_order_ids
                    ],
                }
                for e in self.effects
            ],
            "stuck": [{**asdict(s), "id": str(s.id)} for s in self.stuck_rows],
            "lost": [{**asdict(r), "id": str(r.id)} for r in self.lost_records],
            "problems": self.problems,
            "ok": self.ok,
            "notes": self.notes,
        }


Progress = Callable[[int, int], None]
"""Called with (rows checked against Kafka so far, rows to check)."""


def verify_window(
    engine: sa.Engine,
    *,
    kafka_config: dict[str, str | int | float | bool],
    effects: Sequence[Effect],
    since: datetime,
    until: datetime | None = None,
    max_pending_age_seconds: float = 60.0,
    limit: int = 20,
    progress: Progress | None = None,
    timeout: float = 30.0,
) -> Report:
    """Reconcile the rows created in ``[since, until)`` (aware datetimes; ``until``: now, on the
    database clock).

    ``effects`` are checked for receipts and order; ``limit`` caps each list of offending ids.
    Raises :class:`VerifyError` for an empty window or a partition that does not answer within
    ``timeout`` seconds; SQLAlchemy's and Kafka's own errors propagate.
    """
    conn = engine.connect().execution_options(
        isolation_level="REPEATABLE READ", postgresql_readonly=True
    )
    with conn, conn.begin():
        now: datetime = conn.execute(query("verify_now")).scalar_one()
        end = until or now
        if since >= end:
            raise VerifyError(f"the window [{since}, {end}) is empty: --since must be earlier")
        window = {"since": since, "until": end, "max_pending_age": max_pending_age_seconds}
        summary = OutboxSummary(
            **conn.execute(query("verify_outbox_summary"), window).one()._asdict()
        )
        stuck = [
            StuckRow(**row._asdict())
            for row in conn.execute(query("verify_stuck"), {**window, "limit": limit})
        ]
        verdicts = [_check_effect(conn, effect, window, limit) for effect in effects]
        rows = conn.execute(
            query("verify_published_located"), window, execution_options={"yield_per": _CURSOR_ROWS}
        )
        to_check = summary.published - summary.unlocated

        def checked(done: int) -> None:
            if progress is not None:
                progress(done, to_check)

        checker = _RecordChecker(kafka_config, limit=limit, timeout=timeout)
        try:
            checker.check(rows, checked)
        finally:
            checker.close()
    notes = [PURGED_NOTE]
    if summary.unlocated:
        notes.append(
            f"{summary.unlocated} published row(s) have no stored partition/offset: "
            "their records were not checked"
        )
    return Report(
        database=engine.url.render_as_string(hide_password=True),
        since=since,
        until=end,
        max_pending_age_seconds=max_pending_age_seconds,
        outbox=summary,
        checked=checker.checked,
        lost=checker.lost,
        lost_records=checker.lost_records,
        stuck_rows=stuck,
        effects=verdicts,
        notes=notes,
    )


def _check_effect(
    conn: sa.Connection, effect: Effect, window: dict[str, Any], limit: int
) -> EffectVerdict:
    types = sorted(t.name for t in effect.event_types)
    params = {**window, "effect": effect.name, "types": types, "limit": limit}
    counts = conn.execute(query("verify_effect_summary"), params).one()
    missing: list[UUID] = []
    if counts.applied < counts.expected:
        missing = list(conn.execute(query("verify_not_applied"), params).scalars())
    disorder = conn.execute(query("verify_out_of_order"), params).all()
    return EffectVerdict(
        effect=effect.name,
        event_types=types,
        expected=counts.expected,
        applied=counts.applied,
        out_of_order=disorder[0].total if disorder else 0,
        not_applied_ids=missing,
        out_of_order_ids=[OutOfOrder(row.id, row.previous_id) for row in disorder[:limit]],
    )


class _RecordChecker:
    """Checks published rows, in (topic, partition, offset) order, against their records."""

    def __init__(
        self, config: dict[str, str | int | float | bool], *, limit: int, timeout: float
    ) -> None:
        self._consumer = Consumer(
            {
                **config,
                # Never subscribes nor commits: the group is only a required setting.
                "group.id": "oncely-verify",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
                # Bound librdkafka's prefetch: the check reads one partition at a time.
                "queued.max.messages.kbytes": 16384,
                "queued.min.messages": 10000,
                "fetch.queue.backoff.ms": 5,
            }
        )
        self._limit = limit
        self._timeout = timeout
        self.checked = 0
        self.lost = 0
        self.lost_records: list[LostRecord] = []

    def close(self) -> None:
        self._consumer.close()

    def check(self, rows: Iterable[sa.Row[Any]], progress: Callable[[int], None]) -> None:
        """Check every row (``id, topic, kafka_partition, kafka_offset``); count the lost."""
        topics = self._consumer.list_topics(timeout=self._timeout).topics
        for (topic, partition), group in groupby(
            rows, key=lambda row: (row.topic, row.kafka_partition)
        ):
            reader: _PartitionReader | None = None
            missing = "topic_missing"
            if topic in topics and partition in topics[topic].partitions:
                reader = _PartitionReader(self._consumer, topic, partition, self._timeout)
            elif topic in topics:
                missing = "partition_missing"
            for row in group:
                outcome: tuple[str, str | None] | None = (missing, None)
                if reader is not None:
                    outcome = reader.check(row.kafka_offset, str(row.id))
                self.checked += 1
                if outcome is not None:
                    self.lost += 1
                    if len(self.lost_records) < self._limit:
                        self.lost_records.append(
                            LostRecord(row.id, topic, partition, row.kafka_offset, *outcome)
                        )
                if self.checked % _PROGRESS_EVERY == 0:
                    progress(self.checked)
        progress(self.checked)


class _PartitionReader:
    """Reads one partition forward for ascending offsets; seeks over gaps wider than _SEEK_GAP."""

    def __init__(self, consumer: Consumer, topic: str, partition: int, timeout: float) -> None:
        self._consumer = consumer
        self._topic = topic
        self._partition = partition
        self._timeout = timeout
        self._low, self._high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout
        )
        self._buffer: deque[Message] = deque()
        self._next: int | None = None  # the offset after the last record received
        self._end = False  # the partition's end was reached: nothing more to come

    def check(self, offset: int, event_id: str) -> tuple[str, str | None] | None:
        """``None`` when the record at ``offset`` carries ``event_id``, else (reason, found id)."""
        if offset < self._low:
            return ("deleted", None)
        if offset >= self._high:
            return ("missing", None)
        record = self._record_at(offset)
        if record is None:
            return ("missing", None)
        found = _id_header(record)
        return None if found == event_id else ("id_mismatch", found)

    def _record_at(self, offset: int) -> Message | None:
        while True:
            while self._buffer and _offset(self._buffer[0]) < offset:
                self._buffer.popleft()
            if self._buffer:
                head = self._buffer[0]
                return head if _offset(head) == offset else None
            if self._next is None or offset - self._next > _SEEK_GAP:
                self._consumer.assign([TopicPartition(self._topic, self._partition, offset)])
                self._next, self._end = offset, False
            elif self._end:
                return None
            self._fill()

    def _fill(self) -> None:
        deadline = time.monotonic() + self._timeout
        while not self._buffer and not self._end:
            for message in self._consumer.consume(_FETCH, timeout=0.5):
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(error)
                    if (message.topic(), message.partition()) == (self._topic, self._partition):
                        self._end = True
                elif (message.topic(), message.partition()) == (self._topic, self._partition):
                    self._buffer.append(message)
                    self._next = _offset(message) + 1
            if time.monotonic() > deadline:
                raise VerifyError(
                    f"no record from {self._topic}[{self._partition}] within {self._timeout} s"
                )


def _id_header(message: Message) -> str | None:
    """The record's ``id`` header as text, ``None`` when it has none."""
    raw = message.headers() or []
    for name, value in raw.items() if isinstance(raw, dict) else raw:
        if name == "id":
            return value.decode() if isinstance(value, bytes) else value
    return None


def _offset(message: Message) -> int:
    offset = message.offset()
    assert offset is not None, "a consumed record has an offset"
    return offset
