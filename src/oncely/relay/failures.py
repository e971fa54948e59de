"""How the relay answers a failed or overdue delivery: a :class:`Verdict` per failure (pure
logic; the loop logs, dead-letters and replays as it says).

A failure costs only its shard, which replays from its recorded progress (duplicates, in order).
A transient error (:mod:`oncely.relay.delivery`) waits a backoff first and never dead-letters. A
topic missing or not authorised replays at once: the replay parks the topic's rows. A permanent
error counts against the row only when the error was its own (it went out alone); otherwise the
row becomes a *suspect* and is retried alone first (:mod:`oncely.relay.extent`). After
``max_attempts`` of its own, the row is dead-lettered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID

from oncely.relay import delivery
from oncely.relay.shards import Failure, Page
from oncely.relay.topics import TopicWatch, topic_error_state
from oncely.storage.stores.outbox.rows import OutboxRow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a shard's failure asks: ``backoff`` (its replay waits), ``dead_letter`` (the row
    is dead-lettered with this error, after ``attempts`` of its own, the first at
    ``first_failed_at``), ``forget_limits`` (read the topic's size limit again)."""

    backoff: bool
    dead_letter: str | None = None
    forget_limits: bool = False
    attempts: int = 0
    first_failed_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Overdue:
    """Overdue pages: the shards to replay now, and the pages that wait on (for another
    delivery timeout)."""

    replay: frozenset[int]
    waiting: list[Page]


class Failures:
    """Each row's attempts (and when the first failed, by ``now``) and the suspects (rows that
    failed while not alone)."""

    def __init__(
        self,
        *,
        max_attempts: int,
        delivery_timeout_ms: int,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._max_attempts = max_attempts
        self._timeout_ms = delivery_timeout_ms
        self._now = now
        self._attempts: dict[UUID, int] = {}
        self._first: dict[UUID, datetime] = {}
        self.suspects: set[UUID] = set()

    def judge(self, shard: int, failure: Failure | None) -> Verdict:
        """The verdict on ``shard``'s failure (``None``: its reports are overdue), logged."""
        if failure is None:
            log.warning(
                "delivery timed out after %d ms, replaying shard %d from its recorded progress",
                self._timeout_ms,
                shard,
                extra={"shard": shard, "code": "_MSG_TIMED_OUT"},
            )
            return Verdict(backoff=True)
        row, error = failure.row, failure.error
        if topic_error_state(error) is not None:
            return Verdict(backoff=False)  # the topic is blocked now: the replay parks its rows
        log.warning(
            "delivery failed, replaying shard %d from its recorded progress: %s",
            shard,
            error.str(),
            extra={"id": str(row.id), "topic": row.topic, "shard": shard, "code": error.name()},
        )
        if delivery.is_transient(error):
            return Verdict(backoff=True)
        if not failure.own:
            self.suspects.add(row.id)
            return Verdict(backoff=False, forget_limits=True)
        attempts = self._attempts[row.id] = self._attempts.get(row.id, 0) + 1
        first = self._first.setdefault(row.id, self._now())
        if delivery.goes_dead(error, attempts, max_attempts=self._max_attempts):
            return Verdict(
                backoff=True,
                dead_letter=delivery.error_text(error),
                forget_limits=True,
                attempts=attempts,
                first_failed_at=first,
            )
        return Verdict(backoff=True, forget_limits=True)

    def published(self, rows: Iterable[OutboxRow]) -> None:
        """``rows`` were acknowledged: none of them is a suspect any more."""
        if self.suspects:
            self.suspects.difference_update(row.id for row in rows)

    def dead(self, event_id: UUID) -> None:
        """The row was dead-lettered: its key waits for an operator, its count starts over."""
        self._attempts.pop(event_id, None)
        self._first.pop(event_id, None)
        self.suspects.discard(event_id)


def overdue(pages: list[Page], *, topics: TopicWatch, timeout_ms: int) -> Overdue:
    """Of the overdue ``pages`` (some broker reachable), the shards whose records went to a
    topic gone since (deleted, access revoked: ``topics`` asks the broker again) replay, and
    their rows are parked. The others wait on: librdkafka keeps retrying their records, in
    order, until the broker takes them (a partition without a leader or in-sync replicas), and
    a replay would only queue copies behind them."""
    sent_to = {row.topic for page in pages for row in page.produced}
    topics.forget(sent_to)
    gone = {topic for topic in sent_to if topics.is_blocked(topic)}
    replay: set[int] = set()
    waiting: list[Page] = []
    for page in pages:
        if gone and any(row.topic in gone for row in page.produced):
            replay.add(page.shard)
        else:
            waiting.append(page)
    if waiting:
        log.warning(
            "%d shard(s) have records the broker has not confirmed after %d ms (a partition "
            "without a leader or in-sync replicas?): waiting for them, in order",
            len(waiting),
            timeout_ms,
            extra={"code": "_MSG_TIMED_OUT"},
        )
    return Overdue(frozenset(replay), waiting)
