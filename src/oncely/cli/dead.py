"""``oncely dead list|requeue|skip``: the outbox's dead letters, and delayed rows.

A dead row parks its key: the relay holds the later rows of that topic and key behind it; so
does a delayed row until it is due. ``requeue`` and ``skip`` record a request on the parked key;
the relay holding the key's shard carries it out (``requeue``: the parked row now, then the
held rows, in order; ``skip``: the held rows only, the parked row never). A delayed row is
changed only when named by its id. Both are dry runs unless ``--execute`` (or ``--yes`` for ids
named).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar
from uuid import UUID

import sqlalchemy as sa
import typer
from rich.markup import escape

from oncely.cli._options import DatabaseUrl, Execute, ExecuteNamed
from oncely.cli._output import JsonFlag, out, print_dry_run, print_json
from oncely.errors import ConfigurationError
from oncely.ops import actions
from oncely.storage.stores.outbox import dead
from oncely.storage.stores.outbox.dead import ChangedRow, DeadRow

app = typer.Typer(
    help="Inspect, requeue or skip dead outbox rows, or delayed ones named by id (each parks "
    "its key; a running relay carries out requeue and skip)."
)
T = TypeVar("T")
Reason = Annotated[
    str, typer.Option(help="Why: written with the operation in the audit log (`oncely audit`).")
]


def _with_engine(database_url: str, work: Callable[[sa.Engine], T]) -> T:
    engine = sa.create_engine(database_url)
    try:
        return work(engine)
    finally:
        engine.dispose()


_CARRIED_OUT = {
    "requeue": "a running relay (`oncely relay run`) publishes each row now (dead or delayed), "
    "then the rows held behind its key, in order; `oncely dead list` shows the rows still "
    "waiting",
    "skip": "a running relay (`oncely relay run`) publishes the rows held behind each key "
    "without its dead or delayed row, which is never published (kept in the outbox until "
    "purged); `oncely dead list` shows the rows still waiting",
}


def _print_changed(verb: str, rows: Sequence[ChangedRow], *, as_json: bool) -> None:
    if as_json:
        print_json({"executed": True, "request": verb, "rows": rows})
        return
    out.print(f"{verb} requested for {len(rows)} row(s): {_CARRIED_OUT[verb]}")
    for row in rows:
        out.print(f"  {row.id}  {escape(row.topic)}  key={escape(row.aggregateid)}")


@app.command("list")
def list_(
    database_url: DatabaseUrl,
    topic: Annotated[str | None, typer.Option(help="Only this topic.")] = None,
    delayed: Annotated[
        bool,
        typer.Option(
            "--delayed",
            help="Also list delayed rows (available_at ahead): each parks its key until due.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """List dead rows, oldest first: the rows held behind each one's key, its error, and the
    request (requeue or skip) waiting for a relay to carry it out; with --delayed, delayed rows
    too, with when each is due."""
    rows = _with_engine(database_url, lambda e: dead.list_dead(e, topic=topic, delayed=delayed))
    if as_json:
        print_json({"dead_rows": rows})
        return
    # One line per row (ids whole, to copy), the error (or when it is due) on the next.
    if delayed:
        late = sum(1 for row in rows if row.reason == "delayed")
        out.print(f"{len(rows) - late} dead row(s), {late} delayed row(s)")
    else:
        out.print(f"{len(rows)} dead row(s)")
    for row in rows:
        out.print(
            f"{row.id}  topic={escape(row.topic)}  key={escape(row.aggregateid)}  "
            f"type={escape(row.type or '(purged)')}  held={row.held}  "
            f"request={row.request or '-'}  parked {row.parked_at.isoformat(timespec='seconds')}"
        )
        if row.reason == "delayed" and row.until is not None:
            out.print(f"    delayed until {row.until.isoformat(timespec='seconds')}")
        else:
            out.print(f"    error: {escape(row.error or '-')}")
        if row.attempts is not None and row.first_failed_at is not None:
            out.print(
                f"    {row.attempts} attempt(s), the first failed "
                f"{row.first_failed_at.isoformat(timespec='seconds')}"
            )


def _print_plan(
    verb: str, rows: Sequence[DeadRow], named: Sequence[UUID] | None, *, as_json: bool
) -> None:
    found = {row.id for row in rows}
    not_dead = [i for i in named or () if i not in found]
    if as_json:
        print_json({"executed": False, "request": verb, "rows": rows, "not_dead": not_dead})
        return
    out.print(f"would {verb} {len(rows)} row(s)")
    for row in rows:
        out.print(
            f"  {row.id}  {escape(row.topic)}  key={escape(row.aggregateid)}  "
            f"{escape(row.type or '(purged)')}  held={row.held}"
        )
    for missing in not_dead:
        out.print(f"  {missing}  not a dead or delayed row: unchanged")


@app.command()
def requeue(
    database_url: DatabaseUrl,
    ids: Annotated[
        list[UUID] | None, typer.Argument(help="Row ids (dead, or delayed: published now).")
    ] = None,
    topic: Annotated[str | None, typer.Option(help="Every dead row of this topic.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every dead row.")] = False,
    execute: Execute = False,
    yes: Annotated[
        bool, typer.Option("--yes", help="Requeue the row ids named (as --execute does).")
    ] = False,
    reason: Reason = "",
    as_json: JsonFlag = False,
) -> None:
    """Publish dead rows again, then the rows held behind their keys, in order.

    A delayed row named by its id is published now, before it is due, then the rows held
    behind its key (--topic and --all leave delayed rows to their time). Records the request;
    a running relay (`oncely relay run`) holding the key's shard carries it out. A row that
    fails again stays dead with its new error. A dry run unless --execute (or --yes, for row
    ids named): it lists the rows it would requeue, and changes nothing.
    """
    if not ids and topic is None and not all_:
        raise ConfigurationError("name row ids, --topic T or --all")
    if yes and not ids:
        raise ConfigurationError(
            "--yes confirms the row ids named; use --execute with --topic or --all"
        )
    if not (execute or yes):
        plan = _with_engine(
            database_url, lambda e: actions.plan_requeue(e, ids=ids or None, topic=topic)
        )
        _print_plan("requeue", plan, ids, as_json=as_json)
        if not as_json:
            print_dry_run("--yes" if ids else "--execute")
        return
    rows = _with_engine(
        database_url,
        lambda e: actions.requeue(
            e, operator=actions.Operator.of_cli(), reason=reason, ids=ids or None, topic=topic
        ),
    )
    _print_changed("requeue", rows, as_json=as_json)


@app.command()
def skip(
    database_url: DatabaseUrl,
    ids: Annotated[list[UUID], typer.Argument(help="Row ids (dead, or delayed: never published).")],
    execute: ExecuteNamed = False,
    reason: Reason = "",
    as_json: JsonFlag = False,
) -> None:
    """Give up on dead rows: the rows held behind their keys are published without them.

    A delayed row named is never published: the rows held behind its key go out now without
    it. Records the request; a running relay (`oncely relay run`) carries it out. The skipped
    row stays in the outbox (for audit) until purged. A dry run unless --execute (or --yes): it
    lists the rows it would skip, and changes nothing.
    """
    if not execute:
        plan = _with_engine(database_url, lambda e: actions.plan_skip(e, ids=ids))
        _print_plan("skip", plan, ids, as_json=as_json)
        if not as_json:
            print_dry_run("--yes")
        return
    rows = _with_engine(
        database_url,
        lambda e: actions.skip(e, operator=actions.Operator.of_cli(), ids=ids, reason=reason),
    )
    _print_changed("skip", rows, as_json=as_json)
