"""``oncely tasks run|list|reclaim``: the durable task worker and its operator commands.

Exit codes: 0 success (``run``: stopped by SIGTERM or SIGINT after finishing its task); 1 the
database failed, or ``reclaim`` found no such task or a task that cannot be reclaimed (in its
dry run too); 2 the command could not start (a task name without a handler, a bad target or
argument). ``reclaim`` is a dry run unless ``--yes`` (or ``--execute``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from rich.markup import escape
from rich.table import Table

from oncely.cli._imports import load_tasks
from oncely.cli._options import (
    AppArgument,
    AppOption,
    DatabaseUrl,
    ExecuteNamed,
    LogFormatOption,
    LogLevelOption,
    app_target,
    parse_duration,
    settings_epilog,
    settings_with,
)
from oncely.cli._output import JsonFlag, out, print_dry_run, print_json
from oncely.errors import ConfigurationError
from oncely.runtime.logs import LogFormat, LogLevel, configure_logging
from oncely.settings import TaskSettings
from oncely.storage.tables import TASK_STATUSES

app = typer.Typer(
    help="Run durable tasks (emails, webhooks, API calls) and manage stale and dead ones.",
    no_args_is_help=True,
)


@contextmanager
def _database(database_url: str) -> Iterator[sa.Engine]:
    """An engine for the command, disposed after it; exit 1 when the database fails."""
    engine = sa.create_engine(database_url)
    try:
        yield engine
    finally:
        engine.dispose()


@app.command(epilog=settings_epilog(TaskSettings, "task worker"))
def run(
    target: AppArgument = None,
    *,
    app_option: AppOption = None,
    database_url: DatabaseUrl,
    lease_seconds: Annotated[
        float | None, typer.Option(help="Lease of one attempt.", min=0.1, show_default=False)
    ] = None,
    poll_interval_seconds: Annotated[
        float | None,
        typer.Option(
            help="Longest idle wait between sweeps (NOTIFY wakes the worker sooner).",
            min=0.01,
            show_default=False,
        ),
    ] = None,
    retention: Annotated[
        str | None,
        typer.Option(
            help="Delete finished tasks after this long (e.g. 7d, 12h); stale ones are kept.",
            show_default=False,
        ),
    ] = None,
    max_backoff_seconds: Annotated[
        float | None,
        typer.Option(help="Longest wait between retries.", min=0, show_default=False),
    ] = None,
    owner_id: Annotated[
        str | None,
        typer.Option(
            help="Task lease owner id (default: hostname-pid-random).", show_default=False
        ),
    ] = None,
    poll_seconds: Annotated[float | None, typer.Option(hidden=True)] = None,
    worker_id: Annotated[str | None, typer.Option(hidden=True)] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve /metrics, /healthz, /readyz on this port.", show_default=False),
    ] = None,
    log_format: LogFormatOption = LogFormat.JSON,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Run the tasks of an app until SIGTERM; refuse to start if a task name lacks a handler."""
    from oncely.tasks import run_worker

    tasks = load_tasks(app_target(target, app_option))
    flags: dict[str, Any] = {
        "lease_seconds": lease_seconds,
        "poll_interval_seconds": poll_interval_seconds,
        "poll_seconds": poll_seconds,
        "retention_seconds": None
        if retention is None
        else parse_duration(retention).total_seconds(),
        "max_backoff_seconds": max_backoff_seconds,
        "owner_id": owner_id,
        "worker_id": worker_id,
        "metrics_port": metrics_port,
    }
    settings = settings_with(TaskSettings, flags, names={"retention_seconds": "--retention"})
    configure_logging(level=log_level, log_format=log_format)
    run_worker(tasks, database_url=database_url, settings=settings)


@app.command(name="list")
def list_tasks(
    database_url: DatabaseUrl,
    state: Annotated[
        str | None,
        typer.Option(help=f"Only tasks in this state: {', '.join(TASK_STATUSES)}."),
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.", min=1)] = 50,
    as_json: JsonFlag = False,
) -> None:
    """List the newest tasks (times in UTC)."""
    from oncely.tasks import TaskStore
    from oncely.tasks.rules import iso_z

    if state is not None and state not in TASK_STATUSES:
        raise ConfigurationError(f"unknown state {state!r}: use {', '.join(TASK_STATUSES)}")
    with _database(database_url) as engine:
        records = TaskStore(engine=engine).list_tasks(status=state, limit=limit)
    if as_json:
        print_json({"tasks": records})
        return
    table = Table("id", "name", "key", "policy", "state", "attempts", "available", "lease until")
    table.add_column("last error", overflow="fold")
    for record in records:
        table.add_row(
            str(record.id),
            escape(record.name),
            escape(record.task_key),
            record.policy,
            record.status,
            f"{record.attempts}/{record.max_attempts}",
            iso_z(record.available_at),
            iso_z(record.lease_until),
            escape((record.last_error or "")[:200]),
        )
    out.print(table)
    out.print(f"{len(records)} task(s)")


@app.command()
def reclaim(
    task_id: Annotated[str, typer.Argument(help="The task's id (see `list`).", show_default=False)],
    database_url: DatabaseUrl,
    execute: ExecuteNamed = False,
    reason: Annotated[
        str,
        typer.Option(help="Why: written with the operation in the audit log (`oncely audit`)."),
    ] = "",
    as_json: JsonFlag = False,
) -> None:
    """Queue a stale (or dead, or failed) task again: an operator's decision.

    A dry run unless --yes (or --execute): it shows the task it would queue again, and changes
    nothing. For an irreversible task, first check with the provider (by the task's
    idempotency key, its id) that the effect did not happen.
    """
    from oncely.ops import actions

    try:
        parsed = uuid.UUID(task_id)
    except ValueError:
        raise ConfigurationError(f"{task_id!r} is not a task id (a UUID)") from None
    with _database(database_url) as engine:
        record = (
            actions.reclaim(engine, parsed, operator=actions.Operator.of_cli(), reason=reason)
            if execute
            else actions.plan_reclaim(engine, parsed)
        )
    if as_json:
        print_json({"executed": execute, "task": record})
        return
    if not execute:
        out.print(
            f"would reclaim task {record.id} ({escape(record.name)}, key "
            f"{escape(record.task_key)}): {record.status} after {record.attempts} attempt(s), "
            f"last error: {escape((record.last_error or 'none')[:200])}"
        )
        print_dry_run("--yes")
        return
    out.print(
        f"reclaimed task {record.id} ({escape(record.name)}): queued after "
        f"{record.attempts} attempt(s)"
    )
