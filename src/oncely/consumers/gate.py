"""Which partitions of a consumer deliver: paused ones wait for a time (a retry's backoff) or
for ever (``block``), and a partition sought back (or let go) since the last fetch has its fetched
records dropped, so that no record is applied past a failure (or by two members at once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from confluent_kafka import Consumer, KafkaException, TopicPartition

from oncely.consumers.apply import PartitionId, Record, topic_partition

log = logging.getLogger(__name__)


class PartitionGate:
    """Pauses, resumes and seeks the partitions of ``consumer()`` (the current Kafka client)."""

    def __init__(self, consumer: Callable[[], Consumer]) -> None:
        self._consumer = consumer
        self._paused: dict[PartitionId, float | None] = {}  # resume time, or None while blocked
        self._reset: set[PartitionId] = set()  # partitions sought or paused since the fetch

    @property
    def blocked(self) -> int:
        """How many partitions are paused until the process restarts."""
        return sum(1 for resume in self._paused.values() if resume is None)

    def pause(self, tp: PartitionId, offset: int, *, resume_at: float | None) -> None:
        """Stop ``tp`` at ``offset`` until ``resume_at`` (``time.monotonic()``), or for ever."""
        self._consumer().pause([TopicPartition(tp[0], tp[1], offset)])
        self.seek(tp, offset)
        self._paused[tp] = resume_at

    def resume_due(self, now: float) -> None:
        """Resume the partitions whose pause is over."""
        due = [tp for tp, at in self._paused.items() if at is not None and at <= now]
        if due:
            self._consumer().resume([TopicPartition(t, p) for t, p in due])
            for tp in due:
                del self._paused[tp]

    def seek(self, tp: PartitionId, offset: int) -> None:
        """Read ``tp`` again from ``offset`` (a no-op once it is no longer assigned)."""
        self._reset.add(tp)
        try:
            self._consumer().seek(TopicPartition(tp[0], tp[1], offset))
        except KafkaException as exc:  # no longer assigned: the new owner starts from the commit
            log.info("seek skipped: %s", exc)

    def is_paused(self, tp: PartitionId) -> bool:
        return tp in self._paused

    def forget(self, tps: Sequence[PartitionId]) -> None:
        """``tps`` are no longer this consumer's (revoked, lost): their pauses end with them,
        and their records fetched before are dropped (their new owner applies them)."""
        for tp in tps:
            self._paused.pop(tp, None)
            self._reset.add(tp)

    def assigned(self, tps: Sequence[PartitionId]) -> None:
        """``tps`` are this consumer's again: records of them fetched from here on count."""
        self._reset.difference_update(tps)

    def clear(self) -> None:
        """A new Kafka client: nothing is paused on it."""
        self._paused.clear()

    def fetching(self) -> None:
        """A fetch starts: records fetched from here on follow every seek before it."""
        self._reset.clear()

    def admitted(self, records: list[Record]) -> list[Record]:
        """``records`` without those of partitions sought or paused since the fetch began."""
        if not self._reset:
            return records
        return [r for r in records if topic_partition(r.message) not in self._reset]
