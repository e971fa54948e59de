"""Lanes that keep taking work: one thread per lane, each with its own queue of runs.

The consumer loop splits every fetched batch by key (:func:`~oncely.consumers.lanes.split_lanes`)
and puts each lane's run on that lane's queue, without waiting for the lanes to finish the
batch before. A lane takes what its queue holds (up to ``run_size`` records, one generation
per partition) and applies it in one transaction; the loop collects the lanes' reports, and the
:class:`~oncely.consumers.commit_points.OffsetTracker` turns them into commit points: a partition
commits the contiguous prefix of records that every lane has finished. A slow key holds back
only its own lane, and the commit point of its partition; the other lanes keep applying.

At most ``bound`` records are handed out and not reported (:meth:`LaneWorkers.room`): the loop
stops fetching at the bound, so memory stays flat and a slow lane holds back the fetch.

A record that fails stops its partition *in its lane* at once: the lane skips that partition's
later records of the same generation (they would overtake the failed record's key). The loop
resets the partition in the tracker and seeks it back; records of it that other lanes apply
meanwhile are read again and suppressed by their receipts. Records of partitions given up
(revoked, lost, shutdown) are skipped by the lanes unless already started
(:meth:`LaneWorkers.cancel`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from oncely.consumers.apply import Applier, BatchResult, Failure, PartitionId, Record
from oncely.consumers.commit_points import OffsetTracker
from oncely.consumers.lanes import split_lanes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Run:
    """Records of one lane, in Kafka order per partition, each partition in one generation."""

    records: Sequence[Record]
    generations: dict[PartitionId, int]


@dataclass(frozen=True)
class _Report:
    """What a lane did with ``size`` records it took: ``records`` applied in one transaction
    (the others were skipped), with ``result``."""

    size: int
    records: Sequence[Record]
    generations: dict[PartitionId, int]
    result: BatchResult | None
    error: BaseException | None = None


@dataclass
class Collected:
    """What the lanes reported since the last collection."""

    commit: dict[PartitionId, int] = field(default_factory=dict)
    """Partitions whose commit point moved, and where to."""
    failures: list[Failure] = field(default_factory=list)
    """The records that failed and are still awaited (one per partition, its lowest): their
    partition is reset in the tracker; the caller seeks it back or applies the policy."""
    applied: int = 0
    duplicates: int = 0
    reported: bool = False
    """Whether any lane reported (a transaction ran or records were skipped)."""


class LaneWorkers:
    """``count`` lane threads applying runs with ``applier``; driven from one thread (the
    consumer loop), which must :meth:`close` it."""

    def __init__(self, applier: Applier, count: int, *, run_size: int, bound: int) -> None:
        self.count = count
        self.run_size = run_size
        self.bound = bound
        self._applier = applier
        self.tracker = OffsetTracker()
        self._queues: list[queue.SimpleQueue[_Run | None]] = [
            queue.SimpleQueue() for _ in range(count)
        ]
        self._reports: queue.SimpleQueue[_Report] = queue.SimpleQueue()
        self._in_flight = 0
        # Generations below which a partition's records are skipped (given up by the loop).
        self._live_from: dict[PartitionId, int] = {}
        self._busy = threading.Condition()
        self._started = [0] * count
        self._ended = [0] * count
        name = applier.effect.name
        self._threads = [
            threading.Thread(target=self._lane, args=(i,), name=f"lane-{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    # -- the loop's side --------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Records handed to the lanes and not reported yet."""
        return self._in_flight

    def room(self) -> int:
        """How many more records the lanes may be handed now."""
        return self.bound - self._in_flight

    def submit(self, records: Sequence[Record]) -> None:
        """Hand ``records`` (in Kafka order per partition) to their lanes."""
        offsets: dict[PartitionId, list[int]] = {}
        for record in records:
            message = record.message
            tp = (message.topic() or "", message.partition() or 0)
            offsets.setdefault(tp, []).append(message.offset() or 0)
        generations = {tp: self.tracker.register(tp, run) for tp, run in offsets.items()}
        self._in_flight += len(records)
        for lane, run in enumerate(split_lanes(records, self.count, keep_empty=True)):
            if run:
                self._queues[lane].put(_Run(run, generations))

    def collect(self, wait: float = 0.0) -> Collected:
        """The lanes' reports so far (waiting up to ``wait`` seconds for the first), applied to
        the tracker; raises what a lane raised unexpectedly."""
        collected = Collected()
        try:
            report = self._reports.get(timeout=wait) if wait > 0 else self._reports.get_nowait()
        except queue.Empty:
            return collected
        collected.reported = True
        stops: dict[PartitionId, Failure] = {}
        while True:
            self._in_flight -= report.size
            if report.error is not None:
                raise report.error
            if report.result is not None:
                self._account(report, report.result, collected, stops)
            try:
                report = self._reports.get_nowait()
            except queue.Empty:
                break
        for tp, failure in stops.items():
            self.tracker.reset(tp, failure.offset)
        collected.failures = list(stops.values())
        collected.commit = self.tracker.commit_points()
        return collected

    def _account(
        self,
        report: _Report,
        result: BatchResult,
        collected: Collected,
        stops: dict[PartitionId, Failure],
    ) -> None:
        collected.applied += result.applied
        collected.duplicates += result.duplicates
        done: dict[PartitionId, list[int]] = {}
        for record in report.records:
            message = record.message
            tp = (message.topic() or "", message.partition() or 0)
            offset = message.offset() or 0
            if offset < result.done.get(tp, -1):
                done.setdefault(tp, []).append(offset)
        for tp, offsets in done.items():
            self.tracker.finish(tp, offsets, report.generations[tp])
        for failure in result.failures:
            tp = (failure.message.topic() or "", failure.message.partition() or 0)
            if not self.tracker.is_current(tp, failure.offset, report.generations[tp]):
                continue  # a copy from before a reset: its record is read (and fails) again
            if tp not in stops or failure.offset < stops[tp].offset:
                stops[tp] = failure

    def skip_to(self, tp: PartitionId, offset: int) -> dict[PartitionId, int]:
        """Records of ``tp`` below ``offset`` not handed out count as finished (a dead letter
        was confirmed); returns the commit points that moved."""
        self.tracker.skip_to(tp, offset)
        return self.tracker.commit_points()

    def cancel(self, tps: Iterable[PartitionId]) -> None:
        """The lanes skip the records of ``tps`` handed out so far that they have not started."""
        for tp in tps:
            self._live_from[tp] = self.tracker.generation(tp) + 1

    def settle(self) -> None:
        """Wait until every run a lane has started has ended (its report is then queued)."""
        with self._busy:
            started = list(self._started)
            self._busy.wait_for(
                lambda: all(e >= s for e, s in zip(self._ended, started, strict=True))
            )

    def forget(self, tps: Iterable[PartitionId]) -> None:
        """``tps`` are no longer this consumer's: stop tracking them (after :meth:`cancel`)."""
        self.tracker.forget(tps)

    def partitions(self) -> list[PartitionId]:
        return self.tracker.partitions()

    def close(self) -> None:
        """Stop the lane threads once their current run ends (call :meth:`cancel` first to
        skip what is queued)."""
        for lane in self._queues:
            lane.put(None)
        for thread in self._threads:
            thread.join()

    # -- a lane's side ----------------------------------------------------------------------

    def _lane(self, index: int) -> None:
        lane = self._queues[index]
        stopped: dict[PartitionId, int] = {}  # partitions failed in this lane, by generation
        carry: _Run | None = None  # taken from the queue, applied next time
        while True:
            first = carry if carry is not None else lane.get()
            if first is None:
                return
            runs, carry, closing = self._take(lane, first)
            with self._busy:
                self._started[index] += 1
            try:
                self._reports.put(self._apply(runs, stopped))
            finally:
                with self._busy:
                    self._ended[index] += 1
                    self._busy.notify_all()
            if closing:
                return

    def _take(
        self, lane: queue.SimpleQueue[_Run | None], first: _Run
    ) -> tuple[list[_Run], _Run | None, bool]:
        """``first`` and the runs queued behind it, up to ``run_size`` records, as long as
        each partition stays in one generation; the run that would change one is carried to
        the next transaction. The flag says the lane is being closed."""
        runs = [first]
        size = len(first.records)
        generations = dict(first.generations)
        while size < self.run_size:
            try:
                run = lane.get_nowait()
            except queue.Empty:
                break
            if run is None:
                return runs, None, True
            if any(generations.get(tp, g) != g for tp, g in run.generations.items()):
                return runs, run, False
            runs.append(run)
            generations.update(run.generations)
            size += len(run.records)
        return runs, None, False

    def _apply(self, runs: list[_Run], stopped: dict[PartitionId, int]) -> _Report:
        """One transaction for ``runs``' records, but those of partitions given up or stopped
        in this lane."""
        size = 0
        records: list[Record] = []
        generations: dict[PartitionId, int] = {}
        live_from = self._live_from
        for run in runs:
            size += len(run.records)
            for record in run.records:
                message = record.message
                tp = (message.topic() or "", message.partition() or 0)
                generation = run.generations[tp]
                if generation < live_from.get(tp, 0) or generation <= stopped.get(tp, -1):
                    continue
                generations[tp] = generation
                records.append(record)
        if not records:
            return _Report(size, (), generations, None)
        try:
            result = self._applier.apply(records)
        except BaseException as exc:  # Applier.apply never raises; a bug must not hang the loop
            log.exception("a lane failed unexpectedly")
            return _Report(size, (), generations, None, exc)
        for failure in result.failures:
            tp = (failure.message.topic() or "", failure.message.partition() or 0)
            stopped[tp] = max(stopped.get(tp, -1), generations[tp])
        return _Report(size, records, generations, result)
