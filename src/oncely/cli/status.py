"""``oncely status``: one read-only screen of the outbox, the effects and the tasks.

Exit codes: 0 printed; 3 printed without Kafka's columns (Kafka did not answer: one line of the
report says why); 1 the database failed; 2 bad arguments (an --app that does not load, a
client configuration librdkafka refuses).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from oncely.cli._errors import ExitCode
from oncely.cli._imports import load_app
from oncely.cli._options import APP_HELP, DatabaseUrl
from oncely.cli._output import JsonFlag, out, print_json
from oncely.consumers.completeness import EffectCompleteness
from oncely.ops.status import Status, collect_status
from oncely.settings import KafkaSettings

#: The exit status of a report printed without Kafka's columns.

app = typer.Typer()


@app.command(name="status")
def status(
    database_url: DatabaseUrl,
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(
            "--bootstrap-servers",
            envvar="ONCELY_KAFKA_BOOTSTRAP_SERVERS",
            help="Kafka bootstrap servers, for lag and DLQ depth (without: database only).",
            show_default=False,
        ),
    ] = None,
    app: Annotated[
        str | None,
        typer.Option(
            envvar="ONCELY_APP",
            help=f"{APP_HELP} Its effects' names, groups and topics; without it, effects are "
            "the names in the receipts and their lag and DLQ are unknown.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            help="Refresh a live table every this many seconds until Ctrl-C (not with --json).",
            min=0.5,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Show the outbox backlog per topic and shard, parked keys, shard leases, each effect's
    lag, receipts and DLQ, and tasks by state.

    Unpublished: committed rows the relay's recorded progress has not passed, with the oldest
    one's age. Dead and delayed rows park their keys; later rows of those keys are held (see
    `oncely dead list`). Each relay holding shards is shown with its mode, exactly-once or
    at-least-once. Read-only: one READ ONLY database transaction, Kafka metadata,
    watermarks and committed group offsets. Duplicates suppressed are only in each consumer's
    /metrics, never in the database.

    With --app, one line per effect says how complete it is: published events of its types
    staged longer than ONCELY_COMPLETENESS_GRACE_SECONDS ago (5 min) and within
    ONCELY_COMPLETENESS_WINDOW_SECONDS (24 h) that have neither its receipt nor a dead letter,
    the oldest one and a few ids (`completeness` with --json).

    Kafka gets 10 s (less when every broker refuses the connection): when it
    does not answer, the report still shows everything the database knows, one line (the
    `kafka_error` field with --json) says why, and lag and DLQ show "?" (null).

    Exit status: 0 printed; 3 printed without Kafka's columns (Kafka did not answer); 1 the
    database failed; 2 bad arguments. With --watch, the status of the last report shown.
    """
    import sqlalchemy as sa

    if watch is not None and as_json:
        raise typer.BadParameter(
            "--watch shows a live table: leave out --json", param_hint="--watch"
        )
    effects = load_app(app).effects if app is not None else None
    kafka = (
        None
        if bootstrap_servers is None
        else KafkaSettings(bootstrap_servers=bootstrap_servers).client_config()
    )
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        report = collect_status(engine, effects=effects, kafka_config=kafka)
        if as_json:
            print_json(report.to_json())
        elif watch is None:
            out.print(_render(report, bootstrap_servers))
        else:
            report = _watch(
                watch,
                report,
                lambda: collect_status(engine, effects=effects, kafka_config=kafka),
                bootstrap_servers,
            )
    finally:
        engine.dispose()
    if report.kafka_error is not None:
        raise typer.Exit(ExitCode.KAFKA_UNAVAILABLE)


def _watch(
    seconds: float, report: Status, collect: Callable[[], Status], bootstrap_servers: str | None
) -> Status:
    """Show ``report``, then a fresh one every ``seconds`` in its place, until Ctrl-C; returns
    the last one shown."""
    with Live(_render(report, bootstrap_servers), console=out, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(seconds)
                report = collect()
                live.update(_render(report, bootstrap_servers), refresh=True)
        except KeyboardInterrupt:
            return report  # how a watch ends


def _render(report: Status, bootstrap_servers: str | None) -> Group:
    tasks = Table(*report.tasks, title="tasks by state")
    tasks.add_row(*(str(n) for n in report.tasks.values()))
    return Group(
        f"database {escape(report.database)}"
        + (f", Kafka {escape(bootstrap_servers)}" if bootstrap_servers else ""),
        *(
            [
                f"[bold yellow]Kafka unavailable[/]: {escape(report.kafka_error)}; the lag and "
                "DLQ columns are unknown (?), the rest is the database's"
            ]
            if report.kafka_error is not None
            else []
        ),
        *_outbox(report),
        _relays(report),
        _effects(report),
        *(_completeness(c) for c in report.completeness),
        tasks,
        *(f"[dim]note: {escape(note)}[/]" for note in report.notes),
    )


def _outbox(report: Status) -> list[RenderableType]:
    topics = _table(
        "outbox by topic",
        ["topic"],
        ["unpublished", "oldest", "dead", "delayed", "held keys", "held rows"],
    )
    for t in report.topics:
        topics.add_row(
            escape(t.topic),
            str(t.unpublished),
            _age(t.oldest_unpublished_seconds),
            str(t.dead),
            str(t.delayed),
            str(t.held_keys),
            str(t.held_rows),
        )
    parts: list[RenderableType] = [topics]
    parts += [
        f"{t.requested} dead row(s) of {escape(t.topic)} asked to be requeued or skipped: a "
        "running relay carries it out"
        for t in report.topics
        if t.requested
    ]
    if report.backlog:
        backlog = _table("unpublished by topic and shard", ["topic"], ["shard", "rows", "oldest"])
        for b in report.backlog:
            backlog.add_row(
                escape(b.topic),
                str(b.shard),
                str(b.unpublished),
                _age(b.oldest_unpublished_seconds),
            )
        parts.append(backlog)
    return parts


#: A relay's output mode as the status shows it (``None``: its heartbeats are gone).
_MODES = {True: "exactly-once", False: "at-least-once", None: "?"}


def _relays(report: Status) -> Table:
    relays = _table("shard leases", ["relay", "mode"], ["shards", "epochs"])
    modes = report.modes
    for owner, held in sorted(report.relays.items()):
        epochs = sorted({s.epoch for s in report.shards if s.shard in held and s.owner == owner})
        relays.add_row(escape(owner), _MODES[modes.get(owner)], _ranges(held), _ranges(epochs))
    free = [s.shard for s in report.shards if not s.leased]
    if free:
        relays.add_row("[dim](not leased)[/]", "-", _ranges(free), "-")
    return relays


def _effects(report: Status) -> Table:
    effects = _table(
        "effects", ["effect", "group"], ["lag", "applied", "applied/min", "duplicates", "DLQ"]
    )
    for e in report.effects:
        effects.add_row(
            escape(e.effect),
            escape(e.group or "-"),
            _known(e.lag),
            str(e.applied),
            str(e.applied_last_minute),
            "n/a (see /metrics)",
            _known(e.dlq),
        )
    return effects


def _completeness(checked: EffectCompleteness) -> str:
    """One line per effect: its missing events, the oldest one and a few ids, and the window."""
    if checked.window_start is None or checked.window_end is None:
        return f"completeness of {escape(checked.effect)}: nothing to check yet"
    window = f"staged {_utc(checked.window_start)} to {_utc(checked.window_end)}"
    if not checked.missing:
        return f"completeness of {escape(checked.effect)}: no event missing ({window})"
    shown = ", ".join(map(str, checked.sample_ids[:3]))
    more = ", ..." if checked.missing > 3 else ""
    return (
        f"[bold red]completeness of {escape(checked.effect)}: {checked.missing} event(s) "
        f"missing[/] (no receipt, not dead), oldest created {_utc(checked.oldest_missing_at)}, "
        f"e.g. {shown}{more} ({window})"
    )


def _utc(moment: datetime | None) -> str:
    return "?" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(title: str, names: list[str], numbers: list[str]) -> Table:
    """Names fold rather than being cut (operators copy them); numbers stay whole."""
    table = Table(title=title)
    for name in names:
        table.add_column(name, overflow="fold")
    for number in numbers:
        table.add_column(number, justify="right", no_wrap=True)
    return table


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _ranges(numbers: list[int]) -> str:
    """``0-3, 7``: sorted numbers with runs folded."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _known(value: int | None) -> str:
    return "?" if value is None else str(value)
