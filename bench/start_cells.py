"""R-START: how fast oncely's processes start, against the imports they cannot avoid.

Every side is a fresh Python process, timed from just before it is spawned; the baseline,
``python -c "import sqlalchemy, confluent_kafka"``, runs in the same repetitions:

- **R-START help**: ``oncely --help`` / the baseline (target <= 1.5);
- **R-START relay help**: ``oncely relay run --help`` / the baseline (target <= 1.5);
- **R-START first record**: a relay started on a backlog of 1,000 rows, from its spawn to
  its first record's broker append time (``LogAppendTime``), less the baseline of the same
  repetition, in seconds (target <= 1.0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.fixtures import Bench, Topics, restage, staged_rows
from bench.harness import Cell, interleave

BASELINE = "import sqlalchemy, confluent_kafka"
HELP = "oncely --help"
RELAY_HELP = "oncely relay run --help"
FIRST_RECORD = "relay spawn to first record"
BACKLOG = 1000


def _seconds(argv: list[str]) -> float:
    started = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started


def _first_record(bench: Bench, topics: Topics) -> float:
    topic = topics.new()
    restage(bench, staged_rows(BACKLOG, topic=topic, keys=bench.keys))
    started = time.time()
    relay = subprocess.Popen(
        [sys.executable, "-m", "oncely", "relay", "run"],
        env={**os.environ, **bench.relay_env()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not topics.wait(topic, 1, timeout=120):
            raise TimeoutError("the relay published nothing within 120 s")
    finally:
        relay.terminate()
        relay.wait(60)
    return min(topics.append_times(topic).values()) / 1000 - started


def start_cells(bench: Bench, *, repetitions: int) -> list[Cell]:
    """R-START help, R-START relay help and R-START first record, in one interleaved run."""
    oncely = [sys.executable, "-m", "oncely"]
    topics = Topics(bench)
    try:
        run = interleave(
            {
                BASELINE: lambda: _seconds([sys.executable, "-c", BASELINE]),
                HELP: lambda: _seconds([*oncely, "--help"]),
                RELAY_HELP: lambda: _seconds([*oncely, "relay", "run", "--help"]),
                FIRST_RECORD: lambda: _first_record(bench, topics),
            },
            repetitions=max(repetitions, 5),
        )
    finally:
        topics.close()
    pairs = zip(run.rates[FIRST_RECORD], run.rates[BASELINE], strict=True)
    beyond = {FIRST_RECORD: [first - base for first, base in pairs]}
    note = "each side a fresh process (python -m oncely), timed from just before its spawn"
    cells = [
        Cell(
            "R-START help",
            HELP,
            [BASELINE],
            "s",
            target="<= 1.5",
            measures=f'`{HELP}` / `python -c "{BASELINE}"` (wall seconds)',
            notes=[note],
        ),
        Cell(
            "R-START relay help",
            RELAY_HELP,
            [BASELINE],
            "s",
            target="<= 1.5",
            measures=f'`{RELAY_HELP}` / `python -c "{BASELINE}"` (wall seconds)',
            notes=[note],
        ),
        Cell(
            "R-START first record",
            FIRST_RECORD,
            [],
            "s",
            target="<= 1.0",
            measures=f"a relay started on {BACKLOG} staged rows: seconds from its spawn to its "
            "first record's append time, less the baseline import of the same repetition",
            notes=[note],
        ),
    ]
    for cell in cells:
        cell.take(run, values={**run.rates, **beyond} if not cell.denominators else None)
    return cells
