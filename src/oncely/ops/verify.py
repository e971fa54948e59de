"""``oncely verify``: reconcile one time window across the outbox, Kafka and the receipts.

For the outbox rows created in ``[since, until)`` (committed rows only: the check reads one
REPEATABLE READ, READ ONLY snapshot, on the database clock), :func:`verify_window` reports:

- the window's rows by state: **published** (its shard's recorded progress has passed it: the
  relay had every record of its page acknowledged, and it is not parked or held),
  **unpublished** (the progress has not passed it yet: not a problem by itself), **dead** (it
  parks its key) and **held** (a delayed row, or a row waiting behind a parked key);
- **stuck**: rows not published although due (created, and available) longer than
  ``max_pending_age`` ago;
- **lost**: published rows whose ``id`` is on no record of their topic. Each topic's
  partitions are read from the first record whose timestamp is at or after ``since`` (a
  record's timestamp is its row's ``created_at``, so no record of the window comes earlier) up
  to the high watermarks read after the database snapshot (every row the snapshot shows as
  published was acknowledged before). Memory: the ids of one topic's published rows of the
  window at a time;
- **not applied**, per effect: published rows of the event types the effect consumes without
  its receipt. The receipts' primary key ``(event_id, effect)`` makes a second receipt
  impossible, and a receipt of an event outside the window is no concern of this check;
- **out of order**, per effect: an event applied (receipt ``applied_at``) before the previous
  event of its key in ``seq`` order. Kafka orders a key within its topic's partition only, so
  keys are compared within a topic.

The receipt and order checks run in SQL. Limits: only rows still in ``oncely_outbox`` can be
checked (the relay purges rows its progress passed once they are older than its retention); a
record deleted from its topic (past the topic's retention) counts as lost; a dead row given up
with ``oncely dead skip`` was never published and counts as lost too; and the window should
end a little in the past so that consumers have applied what was just published.
"""

from __future__ import annotations

import time
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
from oncely.settings import ClientConfig
from oncely.storage.stores import receipts
from oncely.storage.stores.outbox.reports import (
    OutboxSummary,
    PublishedRow,
    StuckRow,
    database_now,
    published_rows,
    stuck_rows,
    window_summary,
)
from oncely.storage.stores.receipts import OutOfOrder
from oncely.wire import id_header

#: Records fetched per consume() call.
_FETCH = 2000
#: Report progress every this many records read.
_PROGRESS_EVERY = 1000

PURGED_NOTE = (
    "only rows still in oncely_outbox are checked: rows the relay purged after its retention "
    "(ONCELY_RELAY_RETENTION_SECONDS) cannot be verified"
)


class VerifyError(OncelyError):
    """The verification could not run."""


@dataclass(frozen=True, slots=True)
class LostRecord:
    """A published row whose id is on no record of its topic read for the window.

    ``reason``: ``topic_missing`` (no such topic) or ``missing``.
    """

    id: UUID
    topic: str
    reason: str


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


Tally = Callable[[int, int], None]
"""Called with (rows checked against Kafka so far, rows to check)."""


def verify_window(
    engine: sa.Engine,
    *,
    kafka_config: ClientConfig,
    effects: Sequence[Effect],
    since: datetime,
    until: datetime | None = None,
    max_pending_age_seconds: float = 60.0,
    limit: int = 20,
    progress: Tally | None = None,
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
        end = until or database_now(conn)
        if since >= end:
            raise VerifyError(f"the window [{since}, {end}) is empty: --since must be earlier")
        window: dict[str, Any] = {
            "since": since,
            "until": end,
            "max_pending_age": max_pending_age_seconds,
        }
        summary = window_summary(conn, **window)
        stuck = stuck_rows(conn, **window, limit=limit)
        verdicts = [_check_effect(conn, effect, window, limit) for effect in effects]
        rows = published_rows(conn, **window)

        def checked(done: int) -> None:
            if progress is not None:
                progress(done, summary.published)

        checker = _RecordChecker(kafka_config, since=since, limit=limit, timeout=timeout)
        try:
            checker.check(rows, checked)
        finally:
            checker.close()
    notes = [PURGED_NOTE]
    if summary.unpublished:
        notes.append(
            f"{summary.unpublished} row(s) of the window are not published yet (the relay's "
            "progress has not passed them): not checked in Kafka"
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
    counts = receipts.effect_summary(conn, params)
    missing = receipts.not_applied(conn, params) if counts.applied < counts.expected else []
    disorder, disordered = receipts.out_of_order(conn, params)
    return EffectVerdict(
        effect=effect.name,
        event_types=types,
        expected=counts.expected,
        applied=counts.applied,
        out_of_order=disorder,
        not_applied_ids=missing,
        out_of_order_ids=disordered,
    )


class _RecordChecker:
    """Finds published rows' ids on their topics, one topic at a time."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        since: datetime,
        limit: int,
        timeout: float,
    ) -> None:
        self._consumer = Consumer(
            {
                **config,
                # Never subscribes nor commits: the group is only a required setting.
                "group.id": "oncely-verify",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
                "queued.max.messages.kbytes": 16384,
            }
        )
        self._since_ms = int(since.timestamp() * 1000)
        self._limit = limit
        self._timeout = timeout
        self.checked = 0
        self.lost = 0
        self.lost_records: list[LostRecord] = []

    def close(self) -> None:
        self._consumer.close()

    def check(self, rows: Iterable[PublishedRow], progress: Callable[[int], None]) -> None:
        """Check every row (``id, topic``, grouped by topic); count the lost."""
        topics = self._consumer.list_topics(timeout=self._timeout).topics
        for topic, group in groupby(rows, key=lambda row: row.topic):
            wanted = {str(row.id): row.id for row in group}
            total = len(wanted)
            reason = "topic_missing"
            if topic in topics:
                reason = "missing"
                partitions = sorted(topics[topic].partitions)
                self._read(topic, partitions, wanted, lambda found: progress(self.checked + found))
            self.checked += total
            self.lost += len(wanted)
            for event_id in list(wanted.values())[: max(0, self._limit - len(self.lost_records))]:
                self.lost_records.append(LostRecord(event_id, topic, reason))
            progress(self.checked)

    def _read(
        self,
        topic: str,
        partitions: Sequence[int],
        wanted: dict[str, UUID],
        progress: Callable[[int], None],
    ) -> None:
        """Read ``topic`` from ``since`` to its high watermarks; drop each id found."""
        total = len(wanted)
        starts = self._consumer.offsets_for_times(
            [TopicPartition(topic, p, self._since_ms) for p in partitions], timeout=self._timeout
        )
        ends: dict[int, int] = {}
        assignment = []
        for start in starts:
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(topic, start.partition), timeout=self._timeout
            )
            if 0 <= start.offset < high:
                ends[start.partition] = high
                assignment.append(TopicPartition(topic, start.partition, start.offset))
        if not assignment:
            return
        self._consumer.assign(assignment)
        deadline = time.monotonic() + self._timeout
        read = 0
        try:
            while ends and wanted:
                messages = self._consumer.consume(_FETCH, timeout=0.5)
                if messages:
                    deadline = time.monotonic() + self._timeout
                elif time.monotonic() > deadline:
                    raise VerifyError(
                        f"no record from {topic} within {self._timeout} s (partitions "
                        f"{sorted(ends)} not read to their end)"
                    )
                for message in messages:
                    partition = message.partition()
                    error = message.error()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            raise KafkaException(error)
                        ends.pop(partition if partition is not None else -1, None)
                        continue
                    found = id_header(message)
                    if found is not None:
                        wanted.pop(found, None)
                    read += 1
                    if read % _PROGRESS_EVERY == 0:
                        progress(total - len(wanted))
                    if partition in ends and _offset(message) + 1 >= ends[partition]:
                        del ends[partition]
        finally:
            self._consumer.unassign()


def _offset(message: Message) -> int:
    offset = message.offset()
    assert offset is not None, "a consumed record has an offset"
    return offset
