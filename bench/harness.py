"""How every benchmark cell is measured: sides alternated A/B/A/B, repeated, ratios reported.

This machine is small (2 cores) and shared, so no absolute number is trusted alone: each cell
measures its numerator and denominator in the same run, interleaved, ``repetitions`` times, and
reports the median ratio with its range.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Cell:
    """One benchmark cell: rates per side, and the ratios of the numerator to each denominator."""

    name: str
    numerator: str
    denominators: list[str]
    unit: str
    rates: dict[str, list[float]] = field(default_factory=dict)
    target: str = ""
    notes: list[str] = field(default_factory=list)

    def ratios(self) -> dict[str, dict[str, float]]:
        result = {}
        for denominator in self.denominators:
            pairs = zip(self.rates[self.numerator], self.rates[denominator], strict=True)
            values = [num / den for num, den in pairs if den]
            result[denominator] = {
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
            }
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "cell": self.name,
            "unit": self.unit,
            "numerator": self.numerator,
            "denominators": self.denominators,
            "rates": {side: [round(r, 1) for r in values] for side, values in self.rates.items()},
            "medians": {side: round(statistics.median(v), 1) for side, v in self.rates.items()},
            "ratios": self.ratios(),
            "target": self.target,
            "notes": self.notes,
        }


def alternate(
    sides: Mapping[str, Callable[[], float]], *, repetitions: int, warmup: bool = True
) -> dict[str, list[float]]:
    """Run each side once per repetition, in the same order (A/B/A/B...), after a warm-up."""
    if warmup:
        for side in sides.values():
            side()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repetitions):
        for name, side in sides.items():
            rates[name].append(side())
    return rates


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
