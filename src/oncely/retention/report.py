"""A plan or a run, as a JSON document (``oncely retention plan|run --json``) and as the
``oncely_retention_*`` metrics (the relay's purge timer)."""

from __future__ import annotations

from typing import Any

from oncely.retention.guard import Verdict
from oncely.retention.maintenance import Outcome, Plan, Policy, TableState
from oncely.runtime.metrics import RetentionMetrics
from oncely.storage import partitions


def verdict_document(verdict: Verdict) -> dict[str, Any]:
    """One partition's verdict: its table, name, range, size, and whether it may go (or why
    not)."""
    partition = verdict.partition
    return {
        "table": partition.table,
        "partition": partition.name,
        "lower": partition.lower,
        "upper": partition.upper,
        "bytes": partition.bytes,
        "droppable": verdict.droppable,
        "reason": verdict.reason,
    }


def document(
    plan: Plan | None, outcome: Outcome | None = None, *, tables: list[TableState] | None = None
) -> dict[str, Any]:
    """``plan`` (and what ``outcome`` did, when a run was executed) for ``--json``; ``tables``:
    the states to report instead of the plan's (after a run: what it left). A busy run has no
    plan: its step, time, creations and verdicts are empty."""
    states = tables if tables is not None else plan.tables if plan is not None else []
    found: dict[str, Any] = {
        "executed": outcome is not None,
        "step_seconds": plan.step.total_seconds() if plan is not None else None,
        "now": plan.now if plan is not None else None,
        "create": [
            {"table": table, "partition": partitions.partition_name(table, start), "lower": start}
            for table, start in (plan.create if plan is not None else [])
        ],
        "verdicts": [verdict_document(v) for v in (plan.verdicts if plan is not None else [])],
        "tables": [
            {
                "table": state.table,
                "partitions": state.partitions,
                "bytes": state.bytes,
                "oldest": state.oldest,
                "default_rows": state.default_rows,
                "blocked_seconds": state.blocked_seconds,
            }
            for state in states
        ],
    }
    if outcome is not None:
        found["created"] = outcome.created
        found["dropped"] = outcome.dropped
        found["purged_default_rows"] = outcome.purged
        found["kept"] = [verdict_document(v) for v in outcome.kept]
        found["errors"] = outcome.errors
        found["busy"] = outcome.busy
    return found


def kept_past_horizon(plan: Plan, policy: Policy, outcome: Outcome | None = None) -> list[Verdict]:
    """The closed partitions the guard kept although their range ended before the horizon
    (``outcome``'s when a run was executed, else the plan's)."""
    verdicts = outcome.kept if outcome is not None else plan.verdicts
    return [
        v
        for v in verdicts
        if not v.droppable
        and v.partition.upper is not None
        and v.partition.upper <= plan.now - policy.horizon(v.partition.table)
    ]


def record(
    metrics: RetentionMetrics,
    plan: Plan,
    policy: Policy,
    outcome: Outcome | None = None,
    *,
    tables: list[TableState] | None = None,
) -> None:
    """Set the ``oncely_retention_*`` gauges from ``tables`` (default: the plan's states), and
    count what ``outcome`` dropped and its errors."""
    kept: dict[str, int] = {}
    for verdict in kept_past_horizon(plan, policy, outcome):
        kept[verdict.partition.table] = kept.get(verdict.partition.table, 0) + 1
    for state in plan.tables if tables is None else tables:
        table = state.table
        metrics.partitions.labels(table).set(state.partitions)
        metrics.bytes.labels(table).set(state.bytes)
        metrics.oldest.labels(table).set(state.oldest.timestamp() if state.oldest else 0)
        metrics.default_rows.labels(table).set(state.default_rows)
        metrics.blocked.labels(table).set(state.blocked_seconds)
        metrics.kept.labels(table).set(kept.get(table, 0))
        metrics.dropped.labels(table)  # the series exists from the first run
    if outcome is None:
        return
    dropped = set(outcome.dropped)
    for verdict in plan.verdicts:
        if verdict.partition.name in dropped:
            metrics.dropped.labels(verdict.partition.table).inc()
    if outcome.errors:
        metrics.errors.inc(len(outcome.errors))
