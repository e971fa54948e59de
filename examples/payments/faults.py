"""The demo's fault windows, and its figures outside them and overall.

A **fault window** runs from the moment a fault is injected (the relay's SIGKILL, the consumer's
death between its database commit and its offset commit, the stop of a group before its replay)
to the moment the pipeline has caught up with it:

- after a killed or crashed process: every event committed before the restarted process was
  back (answering ``/readyz``) has its effect applied (its receipt's ``applied_at``); events
  committed while it was coming back or while its backlog drained are then inside the window;
- after a replay: the group has re-read every record (observed by the demo, not from receipts).

An event is **inside** a window when its trip from commit to effect overlaps it: committed
during the window, or committed before it and still not applied when the fault began. Every
other event is **outside** the fault windows.

For a set of events the figures are: commit-to-effect p50 and p99, where commit-to-effect is the
receipt's ``applied_at`` less the outbox row's ``created_at`` (both PostgreSQL clock; the
percentiles interpolate linearly, as ``percentile_cont``), and throughput: the set's events over
the seconds of the run they belong to. The run spans from the first event's commit to the last
effect applied; the outside figures count the run less the time covered by any window.

All times are :class:`datetime` values of the same clock (the database's), so a fault's times
compare with the rows' timestamps. The demo notes a crash when it sees the process gone (it
looks every 0.1 s while writing, every ~0.5 s while draining); a late look moves the window's
start but not which events are inside, since the dead process applies nothing meanwhile.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Trip:
    """One event's trip: committed (outbox ``created_at``), applied (receipt ``applied_at``)."""

    committed: datetime
    applied: datetime

    @property
    def latency_ms(self) -> float:
        return (self.applied - self.committed).total_seconds() * 1000


@dataclass
class Fault:
    """An injected fault as the demo saw it; ``back`` and ``caught_up`` are filled in later.

    ``back``: the faulted process answered ``/readyz`` again. ``caught_up``: the catch-up the
    demo observed itself (the replay); without it the catch-up is computed from the trips.
    """

    name: str
    started: datetime
    back: datetime | None = None
    caught_up: datetime | None = None


@dataclass(frozen=True)
class Window:
    """A fault window: ``start`` (the fault) to ``end`` (the pipeline caught up)."""

    name: str
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    def holds(self, trip: Trip) -> bool:
        """The trip overlaps the window (committed before its end, applied after its start)."""
        return trip.committed <= self.end and trip.applied >= self.start


@dataclass(frozen=True)
class Figures:
    """Commit-to-effect p50/p99 (ms) and throughput of a set of events over ``seconds``."""

    events: int
    seconds: float
    p50_ms: float | None
    p99_ms: float | None

    @property
    def per_second(self) -> float | None:
        return self.events / self.seconds if self.seconds > 0 else None


def windows(faults: Iterable[Fault], trips: Sequence[Trip]) -> list[Window]:
    """Each fault's window, in the order given.

    A fault without an observed catch-up ends when the last event committed before its process
    was back got its effect (never before it was back). A process never seen back leaves the
    window open to the last effect of the run (or its start, when nothing was applied).
    """
    last = max((t.applied for t in trips), default=None)
    result = []
    for fault in faults:
        if fault.caught_up is not None:
            end = fault.caught_up
        elif fault.back is None:
            end = max(fault.started, last or fault.started)
        else:
            back = fault.back
            end = max([back, *(t.applied for t in trips if t.committed <= back)])
        result.append(Window(fault.name, fault.started, max(end, fault.started)))
    return result


def span(trips: Sequence[Trip]) -> tuple[datetime, datetime] | None:
    """The run: first commit to last effect applied (None without trips)."""
    if not trips:
        return None
    return min(t.committed for t in trips), max(t.applied for t in trips)


def covered_seconds(within: tuple[datetime, datetime], windows: Iterable[Window]) -> float:
    """Seconds of ``within`` that some window covers (overlapping windows counted once)."""
    low, high = within
    clipped = sorted(
        (max(w.start, low), min(w.end, high)) for w in windows if w.end > low and w.start < high
    )
    total = 0.0
    current: tuple[datetime, datetime] | None = None
    for start, end in clipped:
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            total += (current[1] - current[0]).total_seconds()
        current = (start, end)
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return total


def figures(trips: Sequence[Trip], seconds: float) -> Figures:
    """p50/p99 of the trips' commit-to-effect latency, and their count over ``seconds``."""
    latencies = sorted(t.latency_ms for t in trips)
    if not latencies:
        return Figures(0, seconds, None, None)
    if len(latencies) == 1:
        return Figures(1, seconds, latencies[0], latencies[0])
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return Figures(len(latencies), seconds, cuts[49], cuts[98])


@dataclass(frozen=True)
class Report:
    """Overall and outside-the-windows figures, the windows, and the events inside each."""

    overall: Figures
    outside: Figures
    inside: int
    windows: list[tuple[Window, list[Trip]]]


def report(faults: Iterable[Fault], trips: Sequence[Trip]) -> Report:
    """The figures of a run: see the module docstring for every definition."""
    found = windows(faults, trips)
    run = span(trips)
    run_seconds = 0.0 if run is None else (run[1] - run[0]).total_seconds()
    outside_seconds = run_seconds - (0.0 if run is None else covered_seconds(run, found))
    per_window = [(w, [t for t in trips if w.holds(t)]) for w in found]
    outside = [t for t in trips if not any(w.holds(t) for w in found)]
    return Report(
        overall=figures(trips, run_seconds),
        outside=figures(outside, outside_seconds),
        inside=len(trips) - len(outside),
        windows=per_window,
    )
