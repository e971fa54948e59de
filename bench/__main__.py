"""``python -m bench [CELL ...]``: run benchmark cells and write JSON, Markdown and a PNG plot.

Cells: R1 R2 R7 (relay), R2b (pgbench claim), R3 (consumer), R4 (latency), R5 (stage cost),
R-DBZ (the relay vs Debezium's Outbox Event Router in a Kafka Connect worker it starts: drain
rate and commit → Kafka latency; about two minutes), and R-CLUSTER (3 consumers vs 1, 2 relays
vs 1, on a 3-broker cluster it starts; not in the default set: it adds several minutes).
Runs against the devstack unless ``ONCELY_DATABASE_URL`` and ``ONCELY_KAFKA_BOOTSTRAP_SERVERS``
name other services. ``make bench`` runs them all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench import cells, consumer_cells, stage
from bench.cluster_cells import cluster_cells
from bench.debezium_cells import debezium_cell
from bench.fixtures import Bench
from bench.harness import environment
from oncely.devstack import DevStack
from oncely.storage import upgrade

ALL = ["R1", "R2", "R2b", "R3", "R4", "R5", "R7", "R-DBZ"]
OPTIONAL = ["R-CLUSTER"]


@contextlib.contextmanager
def _services() -> Iterator[tuple[str, str, dict[str, str]]]:
    url, kafka = (
        os.environ.get("ONCELY_DATABASE_URL"),
        os.environ.get("ONCELY_KAFKA_BOOTSTRAP_SERVERS"),
    )
    if url and kafka:
        yield url, kafka, {"services": "environment"}
        return
    with DevStack() as info:
        yield (
            info.database_url,
            info.kafka_bootstrap,
            {
                "services": "devstack",
                "kafka": info.kafka_version,
                "postgresql": info.postgres_version,
            },
        )


def _markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| cell | numerator / denominator | ratio (median, range) | medians | target |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        if result["cell"] == "R4":
            for level in result["levels"]:
                p, r = level["pipeline_ms"], level["raw_kafka_ms"]
                for label, ours, theirs in (
                    (
                        "commit→effect vs raw produce→consume",
                        "commit_to_effect",
                        "produce_to_consume",
                    ),
                    (
                        "schedule→effect vs raw schedule→consume",
                        "schedule_to_effect",
                        "schedule_to_consume",
                    ),
                ):
                    a, b = p[ours], r[theirs]
                    lines.append(
                        f"| R4 @ {level['load']:.0%} ({level['rate_per_second']}/s) "
                        f"| {label}, p50/p95/p99 | {a['p50']}/{a['p95']}/{a['p99']} vs "
                        f"{b['p50']}/{b['p95']}/{b['p99']} ms | | {result['target']} |"
                    )
            continue
        for denominator, ratio in result["ratios"].items():
            medians = result["medians"]
            lines.append(
                f"| {result['cell']} | {result['numerator']} / {denominator} "
                f"| {ratio['median']} ({ratio['min']} to {ratio['max']}) "
                f"| {medians[result['numerator']]:.0f} / {medians[denominator]:.0f} "
                f"{result['unit']} "
                f"| {result['target']} |"
            )
        latency = result.get("latency")
        if latency:
            relay = latency["sides"][result["numerator"]]["commit_to_kafka_ms"]
            for denominator, ratio in latency["p99_ratios"].items():
                other = latency["sides"][denominator]["commit_to_kafka_ms"]
                lines.append(
                    f"| {result['cell']} @ {latency['load']:.0%} ({latency['rate_per_second']}/s) "
                    f"| commit→Kafka p50/p95/p99, {result['numerator']} / {denominator} "
                    f"| p99 {ratio} | {relay['p50']}/{relay['p95']}/{relay['p99']} vs "
                    f"{other['p50']}/{other['p95']}/{other['p99']} ms | {latency['target']} |"
                )
    return "\n".join(lines) + "\n"


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, errors = [], [], []
    for result in results:
        for denominator, ratio in result.get("ratios", {}).items():
            labels.append(f"{result['cell']}: vs {denominator[:28]}")
            values.append(ratio["median"])
            errors.append([ratio["median"] - ratio["min"], ratio["max"] - ratio["median"]])
    figure, axes = plt.subplots(figsize=(10, 0.5 * len(labels) + 1.5))
    axes.barh(
        labels, values, xerr=list(zip(*errors, strict=True)) if errors else None, color="#4c72b0"
    )
    axes.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xlabel("ratio (median of repetitions; bars show the range)")
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
        "--rows", type=int, default=50_000, help="pre-staged rows for R1/R2/R7 (R-DBZ: a fifth)"
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--records", type=int, default=20_000, help="records for R3")
    parser.add_argument(
        "--latency-seconds", type=float, default=10.0, help="per load level (R4) or side (R-DBZ)"
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    unknown = set(args.cells) - set(ALL) - set(OPTIONAL)
    if unknown:
        parser.error(f"unknown cells {sorted(unknown)}; choose from {ALL + OPTIONAL}")
    results: list[dict[str, Any]] = []
    with _services() as (url, kafka, services):
        engine = sa.create_engine(url, pool_size=8)
        upgrade(engine)
        bench = Bench(
            engine=engine,
            database_url=url,
            bootstrap=kafka,
            rows=args.rows,
            keys=args.keys,
            batch_size=args.batch_size,
        )
        if {"R1", "R2", "R7"} & set(args.cells):
            relay_results = cells.relay_cells(bench, repetitions=args.repetitions)
            results += [c.to_json() for c in relay_results if c.name in args.cells]
        if "R2b" in args.cells:
            results.append(cells.pgbench_claim(bench, repetitions=args.repetitions).to_json())
        if "R3" in args.cells:
            results.append(
                consumer_cells.consumer_cell(
                    bench, repetitions=args.repetitions, count=args.records
                ).to_json()
            )
        if "R4" in args.cells:
            results.append(consumer_cells.latency_cell(bench, seconds=args.latency_seconds))
        if "R-CLUSTER" in args.cells:
            results += [c.to_json() for c in cluster_cells(repetitions=args.repetitions)]
        if "R-DBZ" in args.cells:
            dbz = debezium_cell(
                bench,
                repetitions=args.repetitions,
                rows=max(1000, args.rows // 5),
                seconds=args.latency_seconds,
            )
            results.append(dbz)
            services.update(dbz["environment"])
        if "R5" in args.cells:
            results.append(stage.measure(url, transactions=2000, repetitions=args.repetitions))
        with engine.connect() as conn:
            synchronous_commit = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
        engine.dispose()
    env = environment(
        {
            **services,
            "synchronous_commit": synchronous_commit,
            "rows": args.rows,
            "keys": args.keys,
            "batch_size": args.batch_size,
            "repetitions": args.repetitions,
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    (args.out / f"{stamp}.json").write_text(
        json.dumps({"environment": env, "cells": results}, indent=2) + "\n"
    )
    table = _markdown(results)
    (args.out / f"{stamp}.md").write_text(
        f"# Benchmark {stamp}\n\n`python -m bench {' '.join(args.cells)}`\n\n{table}"
    )
    _plot(results, args.out / f"{stamp}.png")
    print(table)
    print(f"written: {args.out}/{stamp}.json .md .png")


if __name__ == "__main__":
    main()
