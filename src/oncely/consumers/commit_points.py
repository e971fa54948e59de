"""Which offset each partition may commit while lanes finish records out of order.

Records are registered in Kafka order as they are handed to the lanes, and finished as their
lanes commit them, in any order across lanes. A partition's commit point is the offset of its
lowest registered record that is not finished (or, when none is left, the one after the last
registered): the contiguous prefix below it is finished, so a commit never passes a record that
was not applied.

A record that failed makes its partition read again from it (:meth:`OffsetTracker.reset`):
every record at or after it is dropped and the partition's *generation* moves on. Each record
is registered with its partition's generation, and a lane's report counts only while that
record is still registered with the same generation: a copy handed out before the reset may
still be applied by another lane (harmless, its receipt suppresses the copy read again), but
it finishes nothing and its failure is not acted on twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PartitionId = tuple[str, int]


@dataclass
class _Partition:
    generation: int = 0
    order: deque[int] = field(default_factory=deque)  # registered offsets, ascending
    pending: dict[int, int] = field(default_factory=dict)  # offset -> its generation
    end: int | None = None  # the offset after the last registered (or finished past) record
    committed: int | None = None  # the last commit point handed out by ``commit_points``


class OffsetTracker:
    """Per-partition records handed out and not yet finished, and their commit points.

    Pure bookkeeping, used from one thread (the consumer loop).
    """

    def __init__(self) -> None:
        self._partitions: dict[PartitionId, _Partition] = {}

    def __len__(self) -> int:
        """How many registered records are not finished yet (all partitions)."""
        return sum(len(p.pending) for p in self._partitions.values())

    def generation(self, tp: PartitionId) -> int:
        partition = self._partitions.get(tp)
        return partition.generation if partition is not None else 0

    def register(self, tp: PartitionId, offsets: Sequence[int]) -> int:
        """Hand out ``offsets`` of ``tp`` (ascending, past every registered one); returns the
        generation they belong to."""
        partition = self._partitions.setdefault(tp, _Partition())
        generation = partition.generation
        for offset in offsets:
            partition.order.append(offset)
            partition.pending[offset] = generation
        if offsets:
            partition.end = offsets[-1] + 1
        return generation

    def is_current(self, tp: PartitionId, offset: int, generation: int) -> bool:
        """Whether the record at ``offset`` handed out in ``generation`` is still awaited."""
        partition = self._partitions.get(tp)
        return partition is not None and partition.pending.get(offset) == generation

    def finish(self, tp: PartitionId, offsets: Iterable[int], generation: int) -> None:
        """The records at ``offsets`` (handed out in ``generation``) are applied; reports of
        records no longer awaited in that generation are ignored."""
        partition = self._partitions.get(tp)
        if partition is None:
            return
        pending = partition.pending
        for offset in offsets:
            if pending.get(offset) == generation:
                del pending[offset]

    def reset(self, tp: PartitionId, offset: int) -> None:
        """``tp`` is read again from ``offset``: the records at or after it are dropped (what
        was applied of them is suppressed by receipts when read again)."""
        partition = self._partitions.setdefault(tp, _Partition())
        partition.generation += 1
        while partition.order and partition.order[-1] >= offset:
            partition.pending.pop(partition.order.pop(), None)
        partition.end = offset

    def skip_to(self, tp: PartitionId, offset: int) -> None:
        """Every record of ``tp`` below ``offset`` that is not registered counts as finished
        (a dead letter was confirmed); registered ones below it still hold the commit point."""
        partition = self._partitions.setdefault(tp, _Partition())
        partition.end = max(partition.end or offset, offset)

    def forget(self, tps: Iterable[PartitionId]) -> None:
        """``tps`` are no longer this consumer's: their records are dropped; reports of them
        are ignored (their generation moves on)."""
        for tp in tps:  # one generation on, as LaneWorkers.cancel expects, tracked or not
            self._partitions[tp] = _Partition(generation=self.generation(tp) + 1)

    def partitions(self) -> list[PartitionId]:
        """The partitions tracked."""
        return list(self._partitions)

    def pending_in(self, tps: Iterable[PartitionId]) -> int:
        """How many records of ``tps`` are handed out and not finished."""
        return sum(len(self._partitions[tp].pending) for tp in tps if tp in self._partitions)

    def commit_point(self, tp: PartitionId) -> int | None:
        """The offset ``tp`` may commit: every record below it is finished."""
        partition = self._partitions.get(tp)
        if partition is None:
            return None
        order, pending = partition.order, partition.pending
        while order and order[0] not in pending:
            order.popleft()
        return order[0] if order else partition.end

    def commit_points(self) -> dict[PartitionId, int]:
        """The commit points that moved since the last call."""
        moved: dict[PartitionId, int] = {}
        for tp, partition in self._partitions.items():
            point = self.commit_point(tp)
            if point is not None and point != partition.committed:
                partition.committed = point
                moved[tp] = point
        return moved
