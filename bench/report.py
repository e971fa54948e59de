"""A run's results as people read them: the Markdown table of docs/performance.md (one line per
ratio, the first against the target) and the PNG plot of the ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import harness


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _idle(result: dict[str, Any], side: str) -> str:
    value = result.get("cpu_idle_median", {}).get(side)
    return "?" if value is None else f"{value:.0%}"


def table(results: list[dict[str, Any]]) -> str:
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
            met = harness.verdict(result)[0] if first else None
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
    met = harness.verdict(result)[0]
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


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, errors, colours, targets = [], [], [], [], []
    for result in results:
        for denominator, ratio in result.get("ratios", {}).items():
            first = denominator == result["denominators"][0]
            met = harness.verdict(result)[0] if first else None
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
