"""``oncely retention plan|run``: retention of the partitioned outbox and receipts, guarded."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from oncely.cli._errors import ExitCode
from oncely.cli._kafka import BrokerUnreachableError, reached
from oncely.cli._options import (
    BootstrapServers,
    DatabaseUrl,
    Execute,
    parse_duration,
    settings_epilog,
)
from oncely.cli._output import JsonFlag, out, print_dry_run, print_json
from oncely.durations import describe
from oncely.settings import RetentionSettings

if TYPE_CHECKING:
    from oncely.retention import Outcome, Plan, Policy, TableState, Verdict
    from oncely.retention.guard import Watermarks
    from oncely.storage.partitions import Partition

app = typer.Typer(
    help="Drop partitions of the partitioned outbox and receipts that nothing can need again."
)

OutboxHorizon = Annotated[
    str | None,
    typer.Option(
        help="Keep outbox partitions whose range ended less than this long ago (e.g. 7d; "
        "default ONCELY_RELAY_RETENTION_SECONDS): the republish horizon.",
        show_default=False,
    ),
]
ReceiptsHorizon = Annotated[
    str | None,
    typer.Option(
        help="Keep receipts partitions whose range ended less than this long ago (e.g. 21d; "
        "default ONCELY_RETENTION_RECEIPTS_HORIZON_SECONDS).",
        show_default=False,
    ),
]

RunInterval = Annotated[
    str | None,
    typer.Option(
        "--interval",
        help="How long runs are apart at most (e.g. 70m: the schedule plus its starting "
        "deadline; default ONCELY_RETENTION_RUN_INTERVAL_SECONDS): refuse to run when the "
        "partitions created ahead (ONCELY_RETENTION_AHEAD steps) do not outlast it.",
        show_default=False,
    ),
]

_EPILOG = settings_epilog(RetentionSettings, "retention")


@app.command(epilog=_EPILOG)
def plan(
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    outbox_horizon: OutboxHorizon = None,
    receipts_horizon: ReceiptsHorizon = None,
    as_json: JsonFlag = False,
) -> None:
    """Show what `oncely retention run --execute` would do now; changes nothing.

    Lists the partitions it would create ahead, each closed partition with its verdict (it may
    be dropped, or what it waits for: the relay, a parked row, Kafka's retention, the horizon,
    an older partition), and each table's state. Partitions kept are normal, not an error (exit
    0). Exits 2 when the tables are not partitioned (`oncely db upgrade --partition-every`),
    1 when Kafka does not answer.
    """
    current, _, _ = _carry_out(
        database_url, bootstrap_servers, outbox_horizon, receipts_horizon, execute=False
    )
    assert current is not None, "a dry run always plans"
    if as_json:
        from oncely import retention

        print_json(retention.document(current))
        return
    _print_plan(current)


@app.command(epilog=_EPILOG)
def run(
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    outbox_horizon: OutboxHorizon = None,
    receipts_horizon: ReceiptsHorizon = None,
    interval: RunInterval = None,
    execute: Execute = False,
    as_json: JsonFlag = False,
) -> None:
    """Create partitions ahead and drop each partition the guard lets go, oldest first.

    A dry run unless --execute (then the same as `oncely retention plan`). Each drop locks its
    partition (waiting at most ONCELY_RETENTION_LOCK_TIMEOUT_SECONDS), checks it again and
    drops it only if it still may go. Partitions created ahead take the rows of their range
    out of the default partitions; the outbox's default rows no partition will take are
    deleted once the relay has passed them and they are past the outbox horizon. Exits 0 when
    partitions are kept (that is normal), 1 when a partition could not be created ahead or
    Kafka does not answer, 2 when the tables are not partitioned or the partitions ahead do
    not outlast --interval. Run it from a Job (ONCELY_RETENTION_IN_RELAY=false), or let the
    relay run it on its purge timer (the default).
    """
    current, outcome, left = _carry_out(
        database_url,
        bootstrap_servers,
        outbox_horizon,
        receipts_horizon,
        execute=execute,
        interval=interval,
    )
    if as_json:
        from oncely import retention

        print_json(retention.document(current, outcome, tables=left))
    elif outcome is None:
        assert current is not None, "a dry run always plans"
        _print_plan(current)
        print_dry_run()
    else:
        _print_outcome(outcome, left)
    if outcome is not None and outcome.errors:
        raise typer.Exit(ExitCode.FAILED)


def _carry_out(
    database_url: str,
    bootstrap_servers: str,
    outbox_horizon: str | None,
    receipts_horizon: str | None,
    *,
    execute: bool,
    interval: str | None = None,
) -> tuple[Plan | None, Outcome | None, list[TableState]]:
    """The plan (``None`` when the run found another in progress), and when ``execute`` what
    the run did; each table's state after it."""
    import sqlalchemy as sa

    from oncely import retention

    policy = _policy(outbox_horizon, receipts_horizon, interval)
    kafka = reached(bootstrap_servers)
    config = kafka.client_config()
    timeout = RetentionSettings().kafka_timeout_seconds

    def ask(topics: Iterable[str]) -> dict[str, Mapping[int, Watermarks] | None]:
        try:
            return retention.watermarks(config, topics, timeout=timeout)
        except retention.KafkaUnansweredError as exc:
            raise BrokerUnreachableError(
                f"{exc}; check --bootstrap-servers (ONCELY_KAFKA_BOOTSTRAP_SERVERS) and that "
                "the broker runs (nothing was dropped)"
            ) from None

    engine = sa.create_engine(database_url)
    try:
        if not execute:
            current = retention.plan(engine, policy, ask)
            return current, None, current.tables
        outcome = retention.run(engine, policy, ask)
        if outcome.plan is None or outcome.dropped:
            return outcome.plan, outcome, retention.states(engine, policy)
        return outcome.plan, outcome, outcome.plan.tables
    finally:
        engine.dispose()


def _policy(
    outbox_horizon: str | None, receipts_horizon: str | None, interval: str | None = None
) -> Policy:
    from oncely import retention
    from oncely.settings import RelaySettings

    settings = RetentionSettings()
    seconds = settings.run_interval_seconds
    every = timedelta(seconds=seconds) if seconds is not None else None
    return retention.policy_of(
        settings,
        RelaySettings(),
        interval=_horizon(interval, "interval") if interval is not None else every,
        outbox_horizon=None if outbox_horizon is None else _horizon(outbox_horizon, "outbox"),
        receipts_horizon=None
        if receipts_horizon is None
        else _horizon(receipts_horizon, "receipts"),
    )


def _horizon(text: str, option: str) -> timedelta:
    """``text`` as a duration, or BadParameter naming ``--{option}-horizon`` (``--interval``)."""
    try:
        return parse_duration(text)
    except typer.BadParameter as exc:
        hint = "--interval" if option == "interval" else f"--{option}-horizon"
        raise typer.BadParameter(exc.message, param_hint=hint) from None


def _print_plan(current: Plan) -> None:
    from oncely.storage import partitions

    out.print(f"partitions of {describe(current.step)}, now {_moment(current.now)}")
    if current.create:
        names = ", ".join(partitions.partition_name(t, start) for t, start in current.create)
        out.print(f"would create {len(current.create)} partition(s) ahead: {names}")
    _print_verdicts(current, current.verdicts, dropped=())
    _print_states(current.tables)


def _print_outcome(outcome: Outcome, left: list[TableState]) -> None:
    current = outcome.plan
    if current is None:  # busy
        out.print("another retention run is in progress on this database: this one did nothing")
        _print_states(left)
        return
    out.print(f"partitions of {describe(current.step)}, now {_moment(current.now)}")
    if outcome.purged:
        out.print(
            f"deleted {outcome.purged} row(s) of oncely_outbox_default that no partition will take"
        )
    if outcome.created:
        out.print(f"created {len(outcome.created)} partition(s): {', '.join(outcome.created)}")
    dropped = [v for v in current.verdicts if v.partition.name in set(outcome.dropped)]
    _print_verdicts(current, [*dropped, *outcome.kept], dropped=outcome.dropped)
    _print_states(left)
    out.print(f"dropped {len(outcome.dropped)} partition(s), kept {len(outcome.kept)}")
    for error in outcome.errors:
        out.print(f"[red]failed:[/red] {escape(error)}")


def _print_verdicts(current: Plan, verdicts: list[Verdict], *, dropped: Collection[str]) -> None:
    done = set(dropped)
    for state in current.tables:
        mine = sorted(
            (v for v in verdicts if v.partition.table == state.table),
            key=lambda v: v.partition.lower or datetime.max.replace(tzinfo=UTC),
        )
        if not mine:
            out.print(f"{state.table}: no closed partition")
            continue
        table = Table(title=state.table, title_justify="left")
        table.add_column("partition", no_wrap=True)
        table.add_column("range (UTC)", no_wrap=True)
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("verdict")
        for verdict in mine:
            partition = verdict.partition
            if partition.name in done:
                fate = "[green]dropped[/green]"
            elif verdict.droppable:
                fate = "[green]droppable[/green]"
            else:
                fate = f"kept: {escape(verdict.reason or '')}"
            table.add_row(partition.name, _range(partition), _size(partition.bytes), fate)
        _print_table(table)


def _print_table(table: Table) -> None:
    """A table at the terminal's width, or unwrapped when written to a pipe or a log (a Job's
    output): reasons are long lines."""
    if out.is_terminal:
        out.print(table)
    else:
        Console(file=out.file, width=240, soft_wrap=True).print(table)


def _print_states(states: list[TableState]) -> None:
    table = Table(title="tables", title_justify="left")
    for column in ("table", "partitions", "size", "oldest retained", "default rows", "blocked"):
        table.add_column(column)
    for state in states:
        table.add_row(
            state.table,
            str(state.partitions),
            _size(state.bytes),
            _moment(state.oldest),
            str(state.default_rows),
            describe(timedelta(seconds=state.blocked_seconds)) if state.blocked_seconds else "no",
        )
    _print_table(table)


def _range(partition: Partition) -> str:
    """``2026-12-06 06:55 to 06:56`` (the end's date too when it is another day's)."""
    lower, upper = partition.lower, partition.upper
    if lower is None or upper is None:
        return "default"
    lower, upper = lower.astimezone(UTC), upper.astimezone(UTC)
    end = f"{upper:%H:%M}" if upper.date() == lower.date() else f"{upper:%Y-%m-%d %H:%M}"
    return f"{lower:%Y-%m-%d %H:%M} to {end}"


def _moment(moment: datetime | None) -> str:
    return "-" if moment is None else f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"


def _size(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
