"""``python -m bench [CELL ...]``: run benchmark cells and write JSON, Markdown and a PNG plot.

The default set is the table of docs/performance.md (``make bench``; about 45 minutes on 2
cores):

- R-DBZ, R-DBZ-HOT, R-DBZ p99: the relay vs Debezium's Outbox Event Router in a Kafka Connect
  worker the cell starts (drain rate over 1,000 keys and on one key; commit → Kafka p99 at 50%
  of the slower drain rate from writer processes, or at the highest rate the machine can offer
  both sides, probed first);
- R1, R2, R2-xmin, R-HOT, R7: relay drain vs a raw producer, vs its own SQL alone, with a
  REPEATABLE READ transaction held open, on one key, two relay processes vs one;
- R5: the cost of ``stage()`` in a business transaction (one statement, five, 8 writers);
- S-CPU, S-MANY: ``stage()``'s client CPU per event against a raw psycopg INSERT of the same
  row, and ``stage_many()`` of 100 events against one raw 100-row INSERT;
- R-QUIET: commit → Kafka p50/p99 at 200 events/s, relay vs a raw producer after each commit;
- R-EOS, R-EOS-QUIET, R-EOS-RECOVER, R-EOS-OPEN: the relay exactly once vs at least once,
  every time to the record visible to a ``read_committed`` consumer: drain rate (R1's rows),
  commit → visible p50/p99 at 200 events/s, SIGKILL mid-drain → a new relay process's first
  record (seconds; bounded below by the lease), and a plain producer's append → visible p50/p99
  on the same partitions while the relay drains (what open transactions cost it);
- R-QUIET-CPU: CPU per event at 200 events/s above each side's idle, relay + PostgreSQL vs
  Debezium's Kafka Connect worker + PostgreSQL;
- R-IDLE: an idle relay's CPU (relay + PostgreSQL cores) and queries per second
  (``pg_stat_statements``), nothing staged;
- R-CIDLE: an idle consumer process's CPU (cores), assigned and caught up, nothing to consume;
- R3, R3-fair, R3-dup: the consumer with receipts vs a raw consumer with an empty transaction
  per batch, vs one writing the same rows with plain psycopg; a replay of applied records vs
  the first application;
- R-LANES: a handler waiting 2 ms per record, 8 lanes vs 1;
- R4, R4-quiet: commit → effect p99 (absolute ms) at 50% and 10% of the pipeline's drain rate,
  relay, consumer and writers in processes of their own;
- R-RSS: the consumer process's RSS while it applies a 1,000,000-record backlog;
- R-START: ``oncely --help`` and ``oncely relay run --help`` against the imports of
  sqlalchemy and confluent_kafka, and a relay's spawn to its first record;
- R-RETAIN: a soak with retention on, partitioned by minute and unpartitioned side by side
  (table sizes, ``n_dead_tup``, partitions dropped, every event applied once), then the relay's
  drain and R5 partitioned / unpartitioned (``python -m bench R-RETAIN`` runs it alone, about
  12 minutes at ``BENCH_SCALE=0.25``, at least 7 minutes of soak at any scale; when it is among
  the cells, the devstack broker checks log retention every 5 s for the whole run).

Not in the default set: R-CLUSTER (3 consumers vs 1, 2 relays vs 1, on a 3-broker cluster it
starts).

Sizes scale with ``BENCH_SCALE`` (``BENCH_SCALE=0.05 python -m bench R1`` is a smoke run).
Runs against the devstack unless ``ONCELY_DATABASE_URL`` and ``ONCELY_KAFKA_BOOTSTRAP_SERVERS``
name other services. Writes ``bench/results/<date>.json``, ``.md`` (the table to paste into
docs/performance.md) and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import cells, consumer_cells, stage
from bench.cluster_cells import cluster_cells
from bench.debezium_cells import debezium_cells
from bench.eos_cells import eos_cells
from bench.fixtures import Bench
from bench.harness import Target, environment, scaled
from bench.idle_cells import PG_SETTINGS, consumer_idle_cell, idle_cells
from bench.latency_cells import latency_cells
from bench.quiet_cells import quiet_cells
from bench.quiet_cpu_cells import quiet_cpu_cells
from bench.retain_cells import retain_cells, short_retention_checks, soak_result
from bench.start_cells import start_cells
from oncely.devstack import DevStack
from oncely.storage import upgrade

RELAY_CELLS = ["R1", "R2", "R2-xmin", "R-HOT", "R7"]
DBZ_CELLS = ["R-DBZ", "R-DBZ-HOT", "R-DBZ-p99"]
CONSUMER_CELLS = ["R3", "R3-fair", "R3-dup"]
LATENCY_CELLS = ["R4", "R4-quiet"]
EOS_CELLS = ["R-EOS", "R-EOS-QUIET", "R-EOS-RECOVER", "R-EOS-OPEN"]
ALL = [
    *DBZ_CELLS,
    *RELAY_CELLS,
    "R5",
    "S-CPU",
    "S-MANY",
    "R-QUIET",
    *EOS_CELLS,
    "R-QUIET-CPU",
    "R-IDLE",
    "R-CIDLE",
    *CONSUMER_CELLS,
    "R-LANES",
    *LATENCY_CELLS,
    "R-RSS",
    "R-START",
    "R-RETAIN",
]
OPTIONAL = ["R-CLUSTER"]


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


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _idle(result: dict[str, Any], side: str) -> str:
    value = result.get("cpu_idle_median", {}).get(side)
    return "?" if value is None else f"{value:.0%}"


def _markdown(results: list[dict[str, Any]]) -> str:
    """The table of docs/performance.md: one line per ratio, the first one against the target."""
    lines = [
        "| cell | what it measures | ratio (median, range) | medians | CPU idle | target | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.get("kind") == "memory":
            lines.append(_memory_line(result))
            continue
        if result.get("kind") == "soak":
            lines += _soak_lines(result)
            continue
        if result.get("absolute"):
            lines.append(_absolute_line(result))
            continue
        for denominator in result.get("undefined_ratios", []):
            lines.append(_undefined_line(result, denominator))
        for denominator, ratio in result["ratios"].items():
            medians = result["medians"]
            numerator = result["numerator"]
            first = denominator == result["denominators"][0]
            met = Target(result["target"]).met(ratio["median"]) if first else None
            bound = [s for s in (numerator, denominator) if s in result.get("cpu_bound", [])]
            if bound and result.get("verdict_needs_idle"):
                met = None
                verdict = "not a result" if first else ""
            else:
                verdict = "" if met is None else ("met" if met else "**missed**")
            if bound:
                verdict += " (CPU-bound: " + "; ".join(bound) + ")"
            what = result.get("measures") or f"{numerator} / {denominator}"
            if not first:
                what = f"context: {numerator} / {denominator}"
            lines.append(
                f"| {result['cell']} | {what} "
                f"| {ratio['median']} ({ratio['min']} to {ratio['max']}) "
                f"| {_number(medians[numerator])} / {_number(medians[denominator])} "
                f"{result['unit']} "
                f"| {_idle(result, numerator)} / {_idle(result, denominator)} "
                f"| {result['target'] if first else ''} | {verdict.strip()} |"
            )
    return "\n".join(lines) + "\n"


def _undefined_line(result: dict[str, Any], denominator: str) -> str:
    """A ratio whose denominator was at or below zero in a repetition: no number, no verdict."""
    numerator, medians = result["numerator"], result["medians"]
    first = denominator == result["denominators"][0]
    what = result.get("measures") if first else f"context: {numerator} / {denominator}"
    return (
        f"| {result['cell']} | {what or f'{numerator} / {denominator}'} "
        f"| undefined: {denominator} was <= 0 in a repetition "
        f"| {_number(medians[numerator])} / {_number(medians[denominator])} {result['unit']} "
        f"| {_idle(result, numerator)} / {_idle(result, denominator)} "
        f"| {result['target'] if first else ''} | no verdict |"
    )


def _verdict(result: dict[str, Any]) -> str:
    met = result.get("met")
    verdict = "" if met is None else ("met" if met else "**missed**")
    bound = result.get("cpu_bound", [])
    if bound:
        verdict += " (CPU-bound: " + "; ".join(bound) + ")"
    return verdict.strip()


def _absolute_line(result: dict[str, Any]) -> str:
    """An absolute cell (no denominator): its own value against the target, not a ratio."""
    value, side = result["value"], result["numerator"]
    medians = result.get("summary") or f"{_number(result['medians'][side])} {result['unit']}"
    return (
        f"| {result['cell']} | {result['measures']} "
        f"| {value['median']} {result['unit']} ({value['min']} to {value['max']}), absolute "
        f"| {medians} | {_idle(result, side)} | {result['target']} | {_verdict(result)} |"
    )


def _memory_line(result: dict[str, Any]) -> str:
    """R-RSS: one run, RSS at points of the backlog and its peak; no target."""
    rss = result["rss_mib"]
    points = "/".join(str(rss[k]) for k in ("10%", "50%", "90%"))
    growth = result.get("growth_10_to_90")
    flat = "" if growth is None else f"; 10%→90% {growth:+.1%}"
    return (
        f"| {result['cell']} | {result['measures']} | peak {rss['peak']} MiB (one run) "
        f"| RSS at 10%/50%/90% {points} MiB{flat}; {_number(result['rate_per_second'])} "
        "records/s | | reported, flat | |"
    )


def _soak_lines(result: dict[str, Any]) -> list[str]:
    """R-RETAIN's soak: per database and table, size flatness, n_dead_tup and drops; no ratio."""
    lines = []
    for database, summary in result["summary"].items():
        check = summary["check"]
        once = "every event applied once" if check["exactly_once"] else f"**not once**: {check}"
        failed = summary.get("staging_failures_retried") or {}
        logged = summary.get("deadlocks_logged") or {}
        trouble = ", ".join(
            [f"{n} staging {kind} (retried)" for kind, n in failed.items()]
            + [f"{n} deadlocks in the {who}'s log" for who, n in logged.items() if n]
        )
        for table, t in summary["tables"].items():
            flat = (
                "no removal seen"
                if t["max_over_min"] is None
                else f"max/min {t['max_over_min']}, last/first third "
                f"{t['last_third_over_first_third']} from {t['first_removal_s']:.0f} s"
            )
            removed = (
                f"{t['partitions_dropped']} partitions dropped"
                if database == "partitioned"
                else f"{t['rows_deleted']} rows deleted"
            )
            lines.append(
                f"| {result['cell']} | {database} {table}: size from the first drop or purge "
                f"| {flat} | n_dead_tup max {t['n_dead_tup_max']}, size max "
                f"{t['bytes_max'] / 2**20:.1f} MiB, {removed} "
                f"| | flat, n_dead_tup near 0 | {once}{'; ' + trouble if trouble else ''} |"
            )
        if keys := summary.get("keys_table"):
            lines.append(
                f"| {result['cell']} | {database} oncely_outbox_keys (every soak row has an "
                f"idempotency key) | | n_dead_tup max {keys['n_dead_tup_max']}, size max "
                f"{keys['bytes_max'] / 2**20:.1f} MiB | | context | |"
            )
    return lines


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, errors, colours, targets = [], [], [], [], []
    for result in results:
        for denominator, ratio in result.get("ratios", {}).items():
            first = denominator == result["denominators"][0]
            met = Target(result["target"]).met(ratio["median"]) if first else None
            labels.append(result["cell"] if first else f"{result['cell']} (vs {denominator[:48]})")
            values.append(ratio["median"])
            errors.append([ratio["median"] - ratio["min"], ratio["max"] - ratio["median"]])
            colours.append({True: "#55a868", False: "#c44e52", None: "#8c8c8c"}[met])
            number = result["target"].split()[1] if first and met is not None else None
            targets.append(float(number) if number else None)
    figure, axes = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.8))
    axes.barh(
        labels,
        values,
        xerr=list(zip(*errors, strict=True)) if errors else None,
        color=colours,
        ecolor="#555555",
        capsize=3,
    )
    for y, target in enumerate(targets):
        if target is not None:
            axes.plot([target], [y], marker="D", color="black", markersize=7)
    axes.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel(
        "ratio (median of 3 interleaved repetitions, range as error bar; black diamond: target; "
        "green met, red missed, grey context)",
        fontsize=8,
    )
    axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cells", nargs="*", default=ALL, help=f"cells to run (default: {' '.join(ALL)})"
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows per relay drain (default 100,000 x BENCH_SCALE; R-DBZ: 40%% of it)",
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=None, help="relay page size")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--soak-seconds",
        type=float,
        default=None,
        help="R-RETAIN's soak (default 480 s x BENCH_SCALE, at least 420 s: several drops)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    unknown = set(args.cells) - set(ALL) - set(OPTIONAL)
    if unknown:
        parser.error(f"unknown cells {sorted(unknown)}; choose from {ALL + OPTIONAL}")
    rows = args.rows or int(scaled(100_000, minimum=500))
    latency_seconds = scaled(15.0, minimum=3.0)
    quiet_seconds = scaled(30.0, minimum=4.0)
    transactions = int(scaled(4000, minimum=100))
    results: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    started = time.monotonic()
    with _services(short_retention="R-RETAIN" in args.cells) as (url, kafka, services):
        engine = sa.create_engine(url, pool_size=8)
        upgrade(engine)
        bench = Bench(engine=engine, database_url=url, bootstrap=kafka, rows=rows, keys=args.keys)
        if args.batch_size:
            bench.batch_size = args.batch_size
        if set(DBZ_CELLS) & set(args.cells):
            made, details, versions = debezium_cells(
                bench,
                repetitions=args.repetitions,
                rows=max(500, rows * 2 // 5),
                seconds=latency_seconds,
            )
            names = {"R-DBZ": "R-DBZ", "R-DBZ-HOT": "R-DBZ-HOT", "R-DBZ p99": "R-DBZ-p99"}
            results += [c.to_json() for c in made if names[c.name] in args.cells]
            extra["R-DBZ latency"] = details
            services.update(versions)
        relay_wanted = [c for c in RELAY_CELLS if c in args.cells]
        if relay_wanted:
            made = cells.relay_cells(bench, repetitions=args.repetitions, cells=relay_wanted)
            results += [c.to_json() for c in made]
        if "R5" in args.cells:
            made = stage.measure(url, transactions=transactions, repetitions=args.repetitions)
            results += [c.to_json() for c in made]
        if {"S-CPU", "S-MANY"} & set(args.cells):
            made = stage.measure_client(
                url, events=int(scaled(5000, minimum=500)), repetitions=args.repetitions
            )
            results += [c.to_json() for c in made if c.name in args.cells]
        if "R-QUIET" in args.cells:
            made, runs = quiet_cells(bench, repetitions=args.repetitions, seconds=quiet_seconds)
            results += [c.to_json() for c in made]
            extra["R-QUIET runs"] = runs
        eos_wanted = [c for c in EOS_CELLS if c in args.cells]
        if eos_wanted:
            made, details = eos_cells(
                bench, repetitions=args.repetitions, cells=eos_wanted, seconds=quiet_seconds
            )
            results += [c.to_json() for c in made]
            extra.update(details)
        if "R-QUIET-CPU" in args.cells:
            made, runs, versions = quiet_cpu_cells(
                bench,
                repetitions=args.repetitions,
                seconds=scaled(30.0, minimum=10.0),
                idle_seconds=scaled(15.0, minimum=5.0),
            )
            results += [c.to_json() for c in made]
            extra["R-QUIET-CPU runs"] = runs
            services.update(versions)
        if "R-IDLE" in args.cells:
            made, details = idle_cells(
                bench, repetitions=args.repetitions, seconds=scaled(60.0, minimum=10.0)
            )
            results += [c.to_json() for c in made]
            extra["R-IDLE statements"] = details
        if "R-CIDLE" in args.cells:
            cell, details = consumer_idle_cell(
                bench, repetitions=args.repetitions, seconds=scaled(60.0, minimum=10.0)
            )
            results.append(cell.to_json())
            extra["R-CIDLE cores"] = details
        consumer_wanted = [c for c in CONSUMER_CELLS if c in args.cells]
        if consumer_wanted:
            made = consumer_cells.throughput_cells(
                bench,
                repetitions=args.repetitions,
                count=int(scaled(20_000, minimum=1000)),
                cells=consumer_wanted,
            )
            results += [c.to_json() for c in made]
        if "R-LANES" in args.cells:
            cell = consumer_cells.lanes_cell(
                bench, repetitions=args.repetitions, count=int(scaled(10_000, minimum=1000))
            )
            results.append(cell.to_json())
        if set(LATENCY_CELLS) & set(args.cells):
            made, details = latency_cells(
                bench,
                repetitions=args.repetitions,
                seconds=latency_seconds,
                drain_events=int(scaled(20_000, minimum=2000)),
            )
            shown = set(args.cells) | ({"R4 raw Kafka"} if "R4" in args.cells else set())
            results += [c.to_json() for c in made if c.name in shown]
            extra["R4 latency"] = details
        if "R-RSS" in args.cells:
            records = int(scaled(1_000_000, minimum=20_000))
            results.append(consumer_cells.rss_cell(bench, records=records))
        if "R-START" in args.cells:
            results += [c.to_json() for c in start_cells(bench, repetitions=args.repetitions)]
        if "R-RETAIN" in args.cells:
            made, reports = retain_cells(
                bench,
                repetitions=args.repetitions,
                seconds=args.soak_seconds or scaled(480.0, minimum=420.0),
                rate=100.0,
                transactions=transactions,
            )
            results.append(soak_result(reports))
            results += [c.to_json() for c in made]
            extra["R-RETAIN soak"] = reports
        if "R-CLUSTER" in args.cells:
            results += [c.to_json() for c in cluster_cells(repetitions=args.repetitions)]
        with engine.connect() as conn:
            synchronous_commit = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
        engine.dispose()
    env = environment(
        {
            **services,
            "synchronous_commit": synchronous_commit,
            "rows": rows,
            "keys": args.keys,
            "batch_size": bench.batch_size,
            "repetitions": args.repetitions,
            "seconds": round(time.monotonic() - started),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    (args.out / f"{stamp}.json").write_text(
        json.dumps({"environment": env, "cells": results, "details": extra}, indent=2) + "\n"
    )
    table = _markdown(results)
    notes = "\n".join(
        [f"- {r['cell']}: {note}" for r in results for note in r.get("notes", [])]
        + [
            f"- {r['cell']}: CPU cores used in the measured windows (median), {side}: "
            + ", ".join(f"{kind} {value}" for kind, value in cores.items())
            for r in results
            for side, cores in r.get("cpu_cores_median", {}).items()
        ]
    )
    (args.out / f"{stamp}.md").write_text(
        f"# Benchmark {stamp}\n\n`python -m bench {' '.join(args.cells)}` "
        f"(BENCH_SCALE={env['bench_scale']}, {env['cpus']} CPUs, {env['seconds']} s)\n\n"
        f"{table}\n{notes}\n"
    )
    _plot(results, args.out / f"{stamp}.png")
    print(table)
    print(f"written: {args.out}/{stamp}.json .md .png")


if __name__ == "__main__":
    main()
