"""``oncely dead list|requeue|skip``: the outbox's dead letters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar
from uuid import UUID

import sqlalchemy as sa
import typer
from rich.table import Table

from oncely.cli._options import DatabaseUrl, Execute, ExecuteNamed
from oncely.cli._output import err, out, print_dry_run
from oncely.relay import dead
from oncely.relay.dead import ChangedRow, DeadRow

app = typer.Typer(help="Inspect, requeue or skip dead outbox rows (each parks its key).")
T = TypeVar("T")


def _with_engine(database_url: str, work: Callable[[sa.Engine], T]) -> T:
    engine = sa.create_engine(database_url)
    try:
        return work(engine)
    finally:
        engine.dispose()


def _print_changed(verb: str, rows: Sequence[ChangedRow]) -> None:
    out.print(f"{verb} {len(rows)} row(s)")
    for row in rows:
        out.print(f"  {row.id}  {row.topic}  key={row.aggregateid}  {row.type}")


@app.command("list")
def list_(
    database_url: DatabaseUrl,
    topic: Annotated[str | None, typer.Option(help="Only this topic.")] = None,
) -> None:
    """List dead rows, oldest first, with their last error."""
    rows = _with_engine(database_url, lambda e: dead.list_dead(e, topic=topic))
    table = Table(title=f"{len(rows)} dead row(s)")
    for column in ("id", "topic", "key", "type", "attempts", "last error"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row.id), row.topic, row.aggregateid, row.type, str(row.attempts), row.last_error
        )
    out.print(table)


def _print_plan(verb: str, rows: Sequence[DeadRow], named: Sequence[UUID] | None) -> None:
    out.print(f"would {verb} {len(rows)} row(s)")
    for row in rows:
        out.print(f"  {row.id}  {row.topic}  key={row.aggregateid}  {row.type}")
    found = {row.id for row in rows}
    for missing in [i for i in named or () if i not in found]:
        out.print(f"  {missing}  not a dead row: unchanged")


@app.command()
def requeue(
    database_url: DatabaseUrl,
    ids: Annotated[list[UUID] | None, typer.Argument(help="Row ids.")] = None,
    topic: Annotated[str | None, typer.Option(help="Every dead row of this topic.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every dead row.")] = False,
    execute: Execute = False,
    yes: Annotated[
        bool, typer.Option("--yes", help="Requeue the row ids named (as --execute does).")
    ] = False,
) -> None:
    """Make dead rows due again with their attempts reset (their keys are unparked).

    A dry run unless --execute (or --yes, for row ids named): it lists the rows it would
    requeue, and changes nothing.
    """
    if not ids and topic is None and not all_:
        err.print("[red]error:[/] name row ids, --topic T or --all")
        raise typer.Exit(2)
    if yes and not ids:
        err.print(
            "[red]error:[/] --yes confirms the row ids named; use --execute with --topic or --all"
        )
        raise typer.Exit(2)
    if not (execute or yes):
        plan = _with_engine(
            database_url, lambda e: dead.matching_dead(e, ids=ids or None, topic=topic)
        )
        _print_plan("requeue", plan, ids)
        print_dry_run("--yes" if ids else "--execute")
        return
    rows = _with_engine(database_url, lambda e: dead.requeue(e, ids=ids or None, topic=topic))
    _print_changed("requeued", rows)


@app.command()
def skip(
    database_url: DatabaseUrl,
    ids: Annotated[list[UUID], typer.Argument(help="Row ids.")],
    execute: ExecuteNamed = False,
) -> None:
    """Mark dead rows skipped (kept for audit); later rows of their keys flow on.

    A dry run unless --execute (or --yes): it lists the rows it would skip, and changes nothing.
    """
    if not execute:
        plan = _with_engine(database_url, lambda e: dead.matching_dead(e, ids=ids))
        _print_plan("skip", plan, ids)
        print_dry_run("--yes")
        return
    rows = _with_engine(database_url, lambda e: dead.skip(e, ids=ids))
    _print_changed("skipped", rows)
