"""How every benchmark cell is measured: sides interleaved A/B/A/B, repeated, ratios reported.

This machine is small (2 cores) and shared, so no absolute number is trusted alone: each cell
measures its numerator and denominator in the same run, interleaved, ``repetitions`` times, and
reports the median of the per-repetition ratios with their range, next to its target (met or
missed). Every turn also records the machine's CPU idle share (``/proc/stat``) over its measured
window: a side with under :data:`CPU_BOUND_IDLE` idle was limited by the cores that the broker,
PostgreSQL and the code under test share, and the cell says so.

Sizes scale with ``BENCH_SCALE`` (default 1: the full run, about an hour on 2 cores);
``BENCH_SCALE=0.05`` is a smoke run.
"""

from __future__ import annotations

import contextlib
import operator
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A side whose median CPU idle share is below this was CPU-bound.
CPU_BOUND_IDLE = 0.10

_TARGET = re.compile(r"^\s*(>=|<=|<|>)\s*([0-9.]+)")
_COMPARE = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def scale() -> float:
    """``BENCH_SCALE`` (default 1.0): every size of the run is multiplied by it.

    Raises ``SystemExit`` with a one-line message when it is not a positive number.
    """
    text = os.environ.get("BENCH_SCALE", "1")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"BENCH_SCALE={text!r}: give a positive number (1 = the full run)")
    return value


def scaled(full: float, *, minimum: float) -> float:
    """``full`` times :func:`scale`, at least ``minimum``."""
    return max(minimum, full * scale())


def _cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine, from the first line of /proc/stat."""
    with Path("/proc/stat").open() as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


#: What a process is, by its command line: (class, substring), first match wins.
_CLASSES = (
    ("relay", "oncely relay run"),
    ("relay", "-m oncely relay"),
    ("consumer", "oncely consume"),
    ("consumer", "-m oncely consume"),
    ("writers", "bench.writers"),
    ("writers", "multiprocessing.spawn"),
    ("kafka connect", "ConnectStandalone"),
    ("broker", "kafka.Kafka"),
    ("postgres", "postgres"),
)


def _process_times() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of this process and its descendants, by pid, with each one's class
    (relay, broker, kafka connect, postgres, bench: this process, other)."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry.name)], stats[int(entry.name)] = int(fields[1]), fields
    mine, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in mine:
                mine.add(child)
                frontier.append(child)
    tick = os.sysconf("SC_CLK_TCK")
    result = {}
    for pid in mine:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        kind = "bench" if pid == os.getpid() else "other"
        for name, needle in _CLASSES:
            if needle in command:
                kind = name
                break
        fields = stats[pid]
        result[pid] = (kind, (int(fields[11]) + int(fields[12])) / tick)
    return result


class _Idle(threading.local):
    last: float | None = None
    cores: dict[str, float] | None = None


_idle = _Idle()


@dataclass
class Window:
    """What a :func:`cpu_window` measured, filled in when its block ends."""

    #: Wall-clock seconds of the window.
    seconds: float = 0.0
    #: The machine's CPU idle share over it.
    idle: float = 0.0
    #: Cores used, by process class (unrounded).
    cores: dict[str, float] = field(default_factory=dict)
    #: Cores used, by pid: (class, cores) of every process of this process's tree.
    by_pid: dict[int, tuple[str, float]] = field(default_factory=dict)


@contextlib.contextmanager
def cpu_window() -> Iterator[Window]:
    """Mark the measured part of a side: the machine's CPU idle share over it is recorded (and
    returned, with the cores used by class and by pid, in the :class:`Window` it yields)."""
    window = Window()
    idle0, total0 = _cpu_times()
    before, started = _process_times(), time.monotonic()
    try:
        yield window
    finally:
        idle1, total1 = _cpu_times()
        after, wall = _process_times(), max(1e-3, time.monotonic() - started)
        _idle.last = window.idle = (idle1 - idle0) / max(1, total1 - total0)
        window.seconds = wall
        for pid, (kind, seconds) in after.items():
            used = (seconds - before.get(pid, (kind, 0.0))[1]) / wall
            window.by_pid[pid] = (kind, used)
            window.cores[kind] = window.cores.get(kind, 0.0) + used
        _idle.cores = {kind: round(value, 2) for kind, value in sorted(window.cores.items())}


def _take_idle() -> tuple[float | None, dict[str, float] | None]:
    value, cores = _idle.last, _idle.cores
    _idle.last = _idle.cores = None
    return value, cores


@dataclass(frozen=True)
class Target:
    """A cell's target: ``>= x`` or ``> x`` (higher is better), ``<= x`` or ``< x``; any other
    text is context."""

    text: str

    def met(self, ratio: float) -> bool | None:
        match = _TARGET.match(self.text)
        if match is None:
            return None
        return bool(_COMPARE[match.group(1)](ratio, float(match.group(2))))


@dataclass
class Cell:
    """One benchmark cell: values per side, and the ratios of the numerator to each denominator.

    ``rates`` hold one value per repetition for each side (rows/s, tx/s, or ms for latency
    cells); ``idle`` the CPU idle share of each of those turns.

    A cell without denominators is *absolute*: its target applies to the numerator's own
    values (for example a p99 in ms, ``< 25``), not to a ratio; :meth:`value` gives their
    median and range and :meth:`ratios` is empty.
    """

    name: str
    numerator: str
    denominators: list[str]
    unit: str
    rates: dict[str, list[float]] = field(default_factory=dict)
    idle: dict[str, list[float]] = field(default_factory=dict)
    #: Cores used in each turn's measured window, by process class (relay, broker, ...).
    cores: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    target: str = ""
    measures: str = ""
    notes: list[str] = field(default_factory=list)
    #: What the table shows in its "medians" column instead of the sides' medians (optional).
    summary: str = ""
    #: No verdict (met or missed) when a side was CPU-bound: the number is not a result.
    verdict_needs_idle: bool = False
    #: A side whose median CPU idle share is under this was CPU-bound (a cell whose target
    #: names the idle it needs raises it).
    idle_needed: float = CPU_BOUND_IDLE

    @property
    def absolute(self) -> bool:
        return not self.denominators

    def measure(
        self,
        sides: Mapping[str, Callable[[], float]],
        *,
        repetitions: int,
        warmup: bool = True,
    ) -> None:
        """Run the sides interleaved (see :func:`interleave`) and keep this cell's sides."""
        self.take(interleave(sides, repetitions=repetitions, warmup=warmup))

    def take(self, run: Run, *, values: Mapping[str, list[float]] | None = None) -> None:
        """Keep this cell's sides from a run of more sides (``values`` instead of the run's)."""
        for side in (self.numerator, *self.denominators):
            self.rates[side] = list((values or run.rates)[side])
            self.idle[side] = list(run.idle.get(side, []))
            self.cores[side] = list(run.cores.get(side, []))

    def undefined(self) -> list[str]:
        """The denominators with a repetition at or below zero (a latency under the clock's
        resolution, say): their ratio is undefined and gets no verdict."""
        return [side for side in self.denominators if any(v <= 0 for v in self.rates[side])]

    def ratios(self) -> dict[str, dict[str, float]]:
        """The ratio to each denominator whose ratio is defined (see :meth:`undefined`)."""
        result = {}
        undefined = self.undefined()
        for denominator in self.denominators:
            if denominator in undefined:
                continue
            pairs = zip(self.rates[self.numerator], self.rates[denominator], strict=True)
            values = [num / den for num, den in pairs]
            result[denominator] = {
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
            }
        return result

    def value(self) -> dict[str, float]:
        """The numerator's median and range over the repetitions (what an absolute cell's
        target applies to)."""
        values = self.rates[self.numerator]
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    def cpu_bound(self) -> list[str]:
        """The sides whose median CPU idle share was under :attr:`idle_needed`."""
        return [
            side
            for side, values in self.idle.items()
            if values and statistics.median(values) < self.idle_needed
        ]

    def to_json(self) -> dict[str, Any]:
        """The cell as a result-file object, with its verdict (see :func:`verdict`)."""
        result = {
            "cell": self.name,
            "measures": self.measures,
            "unit": self.unit,
            "numerator": self.numerator,
            "denominators": self.denominators,
            "rates": {side: [round(r, 1) for r in values] for side, values in self.rates.items()},
            "medians": {side: round(statistics.median(v), 1) for side, v in self.rates.items()},
            "cpu_idle": {side: [round(x, 3) for x in v] for side, v in self.idle.items()},
            "cpu_idle_median": {
                side: round(statistics.median(v), 3) for side, v in self.idle.items() if v
            },
            "cpu_bound": self.cpu_bound(),
            "cpu_cores": {side: v for side, v in self.cores.items() if v},
            "cpu_cores_median": {side: _median_cores(v) for side, v in self.cores.items() if v},
            "ratios": self.ratios(),
            "undefined_ratios": self.undefined(),
            "absolute": self.absolute,
            **({"value": self.value()} if self.absolute else {}),
            "summary": self.summary,
            "target": self.target,
            "verdict_needs_idle": self.verdict_needs_idle,
            "notes": self.notes,
        }
        result["met"], result["no_verdict"] = verdict(result)
        return result


def verdict(result: Mapping[str, Any]) -> tuple[bool | None, str | None]:
    """Whether a result (a cell's JSON object, of this or an older harness) met its target, and
    why it has no verdict when it should have one.

    A ratio's target applies to its first denominator. No verdict, with the reason, when a
    repetition of that denominator was at or below zero (the ratio is undefined: R-QUIET's raw
    side under the broker clock's 1 ms resolution once gave p50 -0.1 ms and a ratio of -6.8,
    which a ``<=`` target would call met), or when a cell whose target needs idle cores had a
    CPU-bound side. A target that is not a comparison ("reported", "(context)") and a result
    of another kind (memory, soak) have neither a verdict nor a reason.
    """
    target = Target(str(result.get("target", "")))
    if result.get("kind") or _TARGET.match(target.text) is None:
        return None, None
    denominators = result.get("denominators") or []
    if denominators:
        first = denominators[0]
        undefined = result.get("undefined_ratios")
        if undefined is None:  # files from before the harness recorded it: from the values
            undefined = [first] if any(v <= 0 for v in result["rates"][first]) else []
        if first in undefined:
            return None, f"{first} was <= 0 in a repetition: the ratio is undefined"
        value = result["ratios"][first]["median"]
    else:
        value = result["value"]["median"]
    bound = result.get("cpu_bound") or []
    if result.get("verdict_needs_idle") and bound:
        return None, f"CPU-bound ({', '.join(bound)}) and the target needs idle cores"
    return target.met(value), None


def _median_cores(turns: list[dict[str, float]]) -> dict[str, float]:
    kinds = sorted({kind for turn in turns for kind in turn})
    return {k: round(statistics.median(t.get(k, 0.0) for t in turns), 2) for k in kinds}


@dataclass
class Run:
    """What :func:`interleave` measured: per side, one value, one CPU idle share and one
    cores-by-process-class reading per repetition."""

    rates: dict[str, list[float]]
    idle: dict[str, list[float]]
    cores: dict[str, list[dict[str, float]]]


def interleave(
    sides: Mapping[str, Callable[[], float]], *, repetitions: int, warmup: bool = True
) -> Run:
    """Run each side once per repetition, in the same order (A/B/A/B...), after a warm-up turn
    of each; return the values and the CPU use of every turn.

    The idle share is the one over the side's :func:`cpu_window` when it marked one, else over
    the whole turn; cores by process class only come from a :func:`cpu_window`.
    """
    if warmup:
        for name, side in sides.items():
            started = time.monotonic()
            value = side()
            progress(f"warm-up {name}: {value:.1f} ({time.monotonic() - started:.0f} s)")
    rates: dict[str, list[float]] = {name: [] for name in sides}
    idle: dict[str, list[float]] = {name: [] for name in sides}
    cores: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for repetition in range(repetitions):
        for name, side in sides.items():
            _take_idle()
            idle0, total0 = _cpu_times()
            started = time.monotonic()
            rates[name].append(side())
            idle1, total1 = _cpu_times()
            window, used = _take_idle()
            idle[name].append(
                window if window is not None else (idle1 - idle0) / max(1, total1 - total0)
            )
            cores[name].append(used or {})
            progress(
                f"{repetition + 1}/{repetitions} {name}: {rates[name][-1]:.1f}, CPU idle "
                f"{idle[name][-1]:.0%} ({time.monotonic() - started:.0f} s)"
            )
    return Run(rates, idle, cores)


def progress(line: str) -> None:
    """One line of progress on stderr."""
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def alternate(
    sides: Mapping[str, Callable[[], float]], *, repetitions: int, warmup: bool = True
) -> dict[str, list[float]]:
    """:func:`interleave`'s values alone."""
    return interleave(sides, repetitions=repetitions, warmup=warmup).rates


def environment(extra: Mapping[str, Any]) -> dict[str, Any]:
    """What the numbers depend on: machine, load and versions."""
    import confluent_kafka
    import psycopg
    import sqlalchemy

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False)
    return {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "confluent_kafka": confluent_kafka.version()[0],
        "librdkafka": confluent_kafka.libversion()[0],
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "java": (java.stderr or java.stdout).splitlines()[0] if java.returncode == 0 else None,
        "bench_scale": scale(),
        **extra,
    }


def open_loop(rate: float, seconds: float, writers: list[Callable[[int, float], None]]) -> None:
    """Event ``i`` is due at ``t0 + i / rate`` whatever happened before, and goes to writer
    ``i % len(writers)`` as ``writer(i, due)``, with its due time on the wall clock.

    Open loop: a slow system under test shows up as latency measured from ``due``, not as a
    lower offered rate (no coordinated omission).
    """
    total = int(rate * seconds)
    t0 = time.perf_counter() + 0.2
    wall0 = time.time() + (t0 - time.perf_counter())

    def run(offset: int, writer: Callable[[int, float], None]) -> None:
        for i in range(offset, total, len(writers)):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            writer(i, wall0 + i / rate)

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
