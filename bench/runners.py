"""How each group of benchmark cells is run: the sizes of a run, and one function per group that
calls its cell module and returns the cells' results.

A group is the cells one measurement produces together (R1, R2, R2-xmin, R-HOT and R7 share
their drains; the R-DBZ cells share a Kafka Connect worker). :mod:`bench.registry` names the
group of every cell; :mod:`bench.__main__` calls each wanted group once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import cells, completeness, consumer_cells, missing_topic, stage
from bench.cluster_cells import cluster_cells
from bench.debezium_cells import debezium_cells
from bench.eos_cells import eos_cells
from bench.fixtures import Bench
from bench.harness import Cell, scaled
from bench.idle_cells import consumer_idle_cell, idle_cells
from bench.latency_cells import latency_cells
from bench.quiet_cells import quiet_cells
from bench.quiet_cpu_cells import quiet_cpu_cells
from bench.retain_cells import retain_cells, soak_result
from bench.start_cells import start_cells


@dataclass(frozen=True)
class Sizes:
    """The knobs of one run, from the command line and ``BENCH_SCALE``."""

    repetitions: int = 3
    #: Rows per relay drain (R-DBZ drains 40% of it).
    rows: int = 100_000
    keys: int = 1000
    #: R-RETAIN's soak; None: 480 s x BENCH_SCALE, at least 420 s.
    soak_seconds: float | None = None
    #: R-MISSING-TOPIC: NAME=SRC source trees to run the relay from (none: this checkout).
    sides: tuple[str, ...] = ()
    #: R-MISSING-TOPIC's staging window per side.
    missing_topic_seconds: float = 90.0
    #: R-COMPLETENESS: outbox rows in the window (None: 10,000,000 x BENCH_SCALE).
    completeness_rows: int | None = None
    #: R-COMPLETENESS: an empty database to fill (None: an embedded server of its own).
    completeness_database_url: str | None = None


@dataclass
class Outcome:
    """What a group measured: the cells' results (JSON objects), details kept beside them in
    the result file, and versions of the services it started."""

    results: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)


def _json(made: Sequence[Cell]) -> list[dict[str, Any]]:
    return [cell.to_json() for cell in made]


def _latency_seconds() -> float:
    return scaled(15.0, minimum=3.0)


def _quiet_seconds() -> float:
    return scaled(30.0, minimum=4.0)


def _transactions() -> int:
    return int(scaled(4000, minimum=100))


def debezium(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, details, versions = debezium_cells(
        bench,
        repetitions=sizes.repetitions,
        rows=max(500, sizes.rows * 2 // 5),
        seconds=_latency_seconds(),
    )
    return Outcome(_json(made), {"R-DBZ latency": details}, versions)


def relay(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    return Outcome(_json(cells.relay_cells(bench, repetitions=sizes.repetitions, cells=[*wanted])))


def staging(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made = stage.measure(
        bench.database_url, transactions=_transactions(), repetitions=sizes.repetitions
    )
    return Outcome(_json(made))


def staging_client(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made = stage.measure_client(
        bench.database_url, events=int(scaled(5000, minimum=500)), repetitions=sizes.repetitions
    )
    return Outcome(_json(made))


def quiet(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, runs = quiet_cells(bench, repetitions=sizes.repetitions, seconds=_quiet_seconds())
    return Outcome(_json(made), {"R-QUIET runs": runs})


def exactly_once(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, details = eos_cells(
        bench, repetitions=sizes.repetitions, cells=[*wanted], seconds=_quiet_seconds()
    )
    return Outcome(_json(made), details)


def quiet_cpu(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, runs, versions = quiet_cpu_cells(
        bench,
        repetitions=sizes.repetitions,
        seconds=scaled(30.0, minimum=10.0),
        idle_seconds=scaled(15.0, minimum=5.0),
    )
    return Outcome(_json(made), {"R-QUIET-CPU runs": runs}, versions)


def idle_relay(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, details = idle_cells(
        bench, repetitions=sizes.repetitions, seconds=scaled(60.0, minimum=10.0)
    )
    return Outcome(_json(made), {"R-IDLE statements": details})


def idle_consumer(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    cell, details = consumer_idle_cell(
        bench, repetitions=sizes.repetitions, seconds=scaled(60.0, minimum=10.0)
    )
    return Outcome(_json([cell]), {"R-CIDLE cores": details})


def consumer(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made = consumer_cells.throughput_cells(
        bench,
        repetitions=sizes.repetitions,
        count=int(scaled(20_000, minimum=1000)),
        cells=[*wanted],
    )
    return Outcome(_json(made))


def lanes(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    cell = consumer_cells.lanes_cell(
        bench, repetitions=sizes.repetitions, count=int(scaled(10_000, minimum=1000))
    )
    return Outcome(_json([cell]))


def commit_to_effect(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, details = latency_cells(
        bench,
        repetitions=sizes.repetitions,
        seconds=_latency_seconds(),
        drain_events=int(scaled(20_000, minimum=2000)),
    )
    return Outcome(_json(made), {"R4 latency": details})


def rss(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    records = int(scaled(1_000_000, minimum=20_000))
    return Outcome([consumer_cells.rss_cell(bench, records=records)])


def start_up(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    return Outcome(_json(start_cells(bench, repetitions=sizes.repetitions)))


def retention(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    made, reports = retain_cells(
        bench,
        repetitions=sizes.repetitions,
        seconds=sizes.soak_seconds or scaled(480.0, minimum=420.0),
        rate=100.0,
        transactions=_transactions(),
    )
    return Outcome([soak_result(reports), *_json(made)], {"R-RETAIN soak": reports})


def missing(bench: Bench, sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    pairs = [side.split("=", 1) for side in sizes.sides] or [["this", str(missing_topic.HERE)]]
    made, details = missing_topic.missing_topic_cells(
        [(name, Path(src)) for name, src in pairs],
        admin_url=bench.database_url,
        bootstrap=bench.bootstrap,
        seconds=sizes.missing_topic_seconds,
    )
    return Outcome(_json(made), {"R-MISSING-TOPIC sides": details})


# The groups below start the services they measure: they get no shared Bench.


def cluster(sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    database_url = os.environ.get("ONCELY_DATABASE_URL")
    return Outcome(_json(cluster_cells(sizes.repetitions, database_url=database_url)))


def completeness_check(sizes: Sizes, wanted: Sequence[str]) -> Outcome:
    cell, plans = completeness.completeness_cell(
        database_url=sizes.completeness_database_url,
        rows=sizes.completeness_rows or int(scaled(10_000_000, minimum=100_000)),
        repeat=sizes.repetitions,
    )
    return Outcome(_json([cell]), {"R-COMPLETENESS plans": plans})


#: A group run on the shared services (the devstack or the environment's).
SharedRunner = Callable[[Bench, Sizes, Sequence[str]], Outcome]
#: A group that starts its own services.
OwnRunner = Callable[[Sizes, Sequence[str]], Outcome]
