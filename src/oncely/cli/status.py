"""``oncely status``: one read-only screen of the outbox, the effects and the tasks.

Exit codes: 0 printed; 1 the database or Kafka failed; 2 bad arguments (an --app that does not
load).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import sqlalchemy as sa
import typer
from confluent_kafka import KafkaException
from rich.markup import escape
from rich.table import Table

from oncely.cli._imports import load_effects
from oncely.cli._options import DatabaseUrl
from oncely.cli._output import err, out
from oncely.errors import ConfigurationError
from oncely.ops.status import Status, collect_status
from oncely.settings import KafkaSettings

_FAILED = 1
_BAD_ARGUMENTS = 2


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
            help="Effects app (module:attribute): effect names, groups and topics. Without it, "
            "effects are the names in the receipts and their lag and DLQ are unknown.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Show outbox backlog per topic, each effect's lag, receipts and DLQ, and tasks by state.

    Read-only: a READ ONLY database transaction, Kafka metadata, watermarks and committed group
    offsets. Duplicates suppressed are only in each consumer's /metrics, never in the database.
    """
    try:
        effects = load_effects(app) if app is not None else None
    except ConfigurationError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(_BAD_ARGUMENTS) from None
    kafka = (
        None
        if bootstrap_servers is None
        else KafkaSettings(bootstrap_servers=bootstrap_servers).client_config()
    )
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        report = collect_status(engine, effects=effects, kafka_config=kafka)
    except sa.exc.DBAPIError as exc:
        err.print(f"[red]error:[/] database failure: {escape(str(exc.orig))}")
        raise typer.Exit(_FAILED) from None
    except KafkaException as exc:
        err.print(f"[red]error:[/] Kafka failure: {escape(str(exc))}")
        raise typer.Exit(_FAILED) from None
    finally:
        engine.dispose()
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        _print(report, bootstrap_servers)


def _print(report: Status, bootstrap_servers: str | None) -> None:
    out.print(
        f"database {escape(report.database)}"
        + (f", Kafka {escape(bootstrap_servers)}" if bootstrap_servers else "")
    )
    topics = _table("outbox by topic", ["topic"], ["pending", "oldest pending", "dead"])
    topics.add_column("published/min", justify="right", no_wrap=True)
    for t in report.topics:
        oldest = "-" if t.oldest_pending_seconds is None else f"{t.oldest_pending_seconds:.1f}s"
        topics.add_row(
            escape(t.topic), str(t.pending), oldest, str(t.dead), str(t.published_last_minute)
        )
    out.print(topics)
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
    out.print(effects)
    tasks = Table(*report.tasks, title="tasks by state")
    tasks.add_row(*(str(n) for n in report.tasks.values()))
    out.print(tasks)
    for note in report.notes:
        out.print(f"[dim]note: {escape(note)}[/]")


def _table(title: str, names: list[str], numbers: list[str]) -> Table:
    """Names fold rather than being cut (operators copy them); numbers stay whole."""
    table = Table(title=title)
    for name in names:
        table.add_column(name, overflow="fold")
    for number in numbers:
        table.add_column(number, justify="right", no_wrap=True)
    return table


def _known(value: int | None) -> str:
    return "?" if value is None else str(value)
