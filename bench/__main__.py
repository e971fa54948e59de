"""``python -m bench``: the benchmark's one entry point.

- ``python -m bench --list``: every cell (id, slug, estimated time, target, what it measures);
- ``python -m bench [CELL ...]``: run cells, by id or slug (none: the default run, ``make
  bench``, about an hour on 2 cores: see ``--list``), write
  ``bench/results/<date>-<time>-<cells>.json`` (every value, the environment, the commit
  measured), ``.md`` (the table) and ``.png``, then regenerate ``bench/results/INDEX.md`` and
  the current figures of docs/performance.md;
- ``python -m bench compare A.json B.json``: two result files' figures side by side;
- ``python -m bench index``: regenerate the index and the current figures from the files.

Sizes scale with ``BENCH_SCALE`` (``BENCH_SCALE=0.05 python -m bench R1`` is a smoke run).
Runs against the devstack unless ``ONCELY_DATABASE_URL`` and ``ONCELY_KAFKA_BOOTSTRAP_SERVERS``
name other services; R-CLUSTER and R-COMPLETENESS start services of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import report, result_files
from bench.fixtures import Bench
from bench.harness import environment, progress, scaled
from bench.idle_cells import PG_SETTINGS
from bench.registry import DEFAULT, Spec, UnknownCellError, listing, owner, resolve
from bench.retain_cells import short_retention_checks
from bench.runners import Outcome, Sizes
from oncely.devstack import DevStack
from oncely.storage import upgrade

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "performance.md"


@contextlib.contextmanager
def _services(*, short_retention: bool = False) -> Iterator[tuple[str, str, dict[str, str]]]:
    url, kafka = (
        os.environ.get("ONCELY_DATABASE_URL"),
        os.environ.get("ONCELY_KAFKA_BOOTSTRAP_SERVERS"),
    )
    if url and kafka:
        yield url, kafka, {"services": "environment"}
        return
    # pg_stat_statements is preloaded, tracking nothing unless a cell asks (R-IDLE). R-RETAIN
    # needs the broker to delete expired segments within seconds, not its default 5 minutes.
    checks = short_retention_checks() if short_retention else contextlib.nullcontext()
    with checks, DevStack(postgres_settings=PG_SETTINGS) as info:
        yield (
            info.database_url,
            info.kafka_bootstrap,
            {
                "services": "devstack",
                "kafka": info.kafka_version,
                "postgresql": info.postgres_version,
            },
        )


def _groups(specs: Sequence[Spec]) -> dict[Any, list[str]]:
    """The wanted cells' ids by the function that runs their group, in registry order."""
    groups: dict[Any, list[str]] = {}
    for spec in specs:
        groups.setdefault(spec.run, []).append(spec.id)
    return groups


def measure(
    specs: Sequence[Spec], sizes: Sizes, batch_size: int | None
) -> tuple[Outcome, dict[str, Any]]:
    """Run every wanted cell's group once; keep the results of the wanted cells (and any
    figure no cell declares, with a warning). Returns them and the settings of the shared
    services the run read (``synchronous_commit``, the relay's page size)."""
    outcome = Outcome()
    shared = [s for s in specs if not s.own_services]
    settings: dict[str, Any] = {}

    def keep(made: Outcome) -> None:
        for result in made.results:
            spec = owner(result["cell"])
            if spec is None:
                progress(f"{result['cell']}: a figure no cell of bench/registry.py declares")
            elif spec not in specs:
                continue
            elif result.get("target") != spec.figures.get(result["cell"], result.get("target")):
                progress(
                    f"{result['cell']}: target {result.get('target')!r} in the cell, "
                    f"{spec.figures[result['cell']]!r} in bench/registry.py"
                )
            outcome.results.append(result)
        outcome.details.update(made.details)
        outcome.services.update(made.services)

    if shared:
        retain = any(s.id == "R-RETAIN" for s in shared)
        with _services(short_retention=retain) as (url, kafka, services):
            outcome.services.update(services)
            engine = sa.create_engine(url, pool_size=8)
            upgrade(engine)
            bench = Bench(
                engine=engine, database_url=url, bootstrap=kafka, rows=sizes.rows, keys=sizes.keys
            )
            if batch_size:
                bench.batch_size = batch_size
            for run, ids in _groups(shared).items():
                keep(run(bench, sizes, ids))
            with engine.connect() as conn:
                settings["synchronous_commit"] = conn.execute(
                    sa.text("SHOW synchronous_commit")
                ).scalar_one()
            settings["batch_size"] = bench.batch_size
            engine.dispose()
    for run, ids in _groups([s for s in specs if s.own_services]).items():
        keep(run(sizes, ids))
    return outcome, settings


def _notes(results: list[dict[str, Any]]) -> str:
    return "\n".join(
        [f"- {r['cell']}: {note}" for r in results for note in r.get("notes", [])]
        + [
            f"- {r['cell']}: CPU cores used in the measured windows (median), {side}: "
            + ", ".join(f"{kind} {value}" for kind, value in cores.items())
            for r in results
            for side, cores in r.get("cpu_cores_median", {}).items()
        ]
    )


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run benchmark cells (by id or slug; none: the default run).",
        epilog="Also: python -m bench compare A.json B.json; python -m bench index.",
    )
    parser.add_argument("cells", nargs="*", help="cells to run (python -m bench --list)")
    parser.add_argument("--list", action="store_true", help="list every cell and exit")
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows per relay drain (default 100,000 x BENCH_SCALE; R-DBZ: 40%% of it)",
    )
    parser.add_argument("--keys", type=int, default=1000, help="keys of the staged rows")
    parser.add_argument("--batch-size", type=int, default=None, help="relay page size")
    parser.add_argument(
        "--repetitions",
        type=int,
        default=3,
        help="interleaved repetitions of every side (R-COMPLETENESS: checks)",
    )
    parser.add_argument(
        "--soak-seconds",
        type=float,
        default=None,
        help="R-RETAIN's soak (default 480 s x BENCH_SCALE, at least 420 s: several drops)",
    )
    parser.add_argument(
        "--side",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="R-MISSING-TOPIC: run the relay from this source tree (repeatable; default: this "
        "checkout)",
    )
    parser.add_argument(
        "--missing-topic-seconds", type=float, default=90.0, help="R-MISSING-TOPIC: per side"
    )
    parser.add_argument(
        "--completeness-rows",
        type=int,
        default=None,
        help="R-COMPLETENESS: outbox rows (default 10,000,000 x BENCH_SCALE)",
    )
    parser.add_argument(
        "--completeness-database-url",
        default=None,
        help="R-COMPLETENESS: an empty database to fill (default: an embedded server)",
    )
    parser.add_argument(
        "--out", type=Path, default=result_files.RESULTS, help="folder of the result files"
    )
    return parser


def run(argv: Sequence[str]) -> None:
    """``python -m bench [CELL ...]``: see the module's docstring."""
    parser = _run_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return
    try:
        specs = resolve(args.cells) if args.cells else list(DEFAULT)
    except UnknownCellError as error:
        parser.error(str(error))
    sizes = Sizes(
        repetitions=args.repetitions,
        rows=args.rows or int(scaled(100_000, minimum=500)),
        keys=args.keys,
        soak_seconds=args.soak_seconds,
        sides=tuple(args.side),
        missing_topic_seconds=args.missing_topic_seconds,
        completeness_rows=args.completeness_rows,
        completeness_database_url=args.completeness_database_url,
    )
    started_at, started = datetime.now(UTC), time.monotonic()
    measured = result_files.provenance(ROOT)  # before the run: what the cells ran
    if measured["dirty"]:
        progress(f"the tree differs from {measured['commit']}: the results will say dirty")
    outcome, settings = measure(specs, sizes, args.batch_size)
    command = "python -m bench " + " ".join(argv)
    env = environment(
        {
            **outcome.services,
            **settings,
            **measured,
            "started": started_at.isoformat(timespec="seconds"),
            "command": command.strip(),
            "rows": sizes.rows,
            "keys": sizes.keys,
            "repetitions": sizes.repetitions,
            "seconds": round(time.monotonic() - started),
        }
    )
    results = outcome.results
    table = report.table(results)
    commit = f"{env['commit'] or 'unknown'}{' (dirty)' if env['dirty'] else ''}"
    name = result_files.write(
        args.out,
        result_files.stem(started_at, [s.id for s in specs], default=not args.cells),
        {
            ".json": json.dumps(
                {"environment": env, "cells": results, "details": outcome.details}, indent=2
            )
            + "\n",
            ".md": f"# Benchmark {started_at:%Y-%m-%d %H:%M} UTC\n\n`{command.strip()}` "
            f"(BENCH_SCALE={env['bench_scale']}, {env['cpus']} CPUs, {env['seconds']} s) "
            f"on commit {commit}\n\n{table}\n{_notes(results)}\n",
        },
    )
    print(table)
    print(f"written: {args.out}/{name}.json .md")
    if args.out.resolve() == result_files.RESULTS:
        result_files.refresh(result_files.RESULTS, DOCS)
        print(f"updated: {result_files.RESULTS / result_files.INDEX} and {DOCS}")
    else:
        (args.out / result_files.INDEX).write_text(result_files.index(args.out))
    report.plot(results, args.out / f"{name}.png")  # last: it needs matplotlib (make bench)
    print(f"written: {args.out}/{name}.png")


def compare(argv: Sequence[str]) -> None:
    """``python -m bench compare A.json B.json``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench compare", description="Two result files' figures side by side."
    )
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    print(result_files.compare(args.a, args.b), end="")


def index(argv: Sequence[str]) -> None:
    """``python -m bench index``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench index",
        description=f"Regenerate {result_files.INDEX} and the current figures of "
        "docs/performance.md from the result files.",
    )
    parser.parse_args(argv)
    result_files.refresh(result_files.RESULTS, DOCS)
    print(f"updated: {result_files.RESULTS / result_files.INDEX} and {DOCS}")


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"compare": compare, "index": index}
    if argv and argv[0] in commands:
        commands[argv[0]](argv[1:])
    else:
        run(argv)


if __name__ == "__main__":
    main()
