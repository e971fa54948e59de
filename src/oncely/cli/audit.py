"""``oncely audit``: the operators' audit log, newest first (read-only)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from oncely.cli._options import DatabaseUrl
from oncely.cli._output import JsonFlag, out, print_json

app = typer.Typer()


@app.command(name="audit")
def audit_log(
    database_url: DatabaseUrl,
    action: Annotated[
        str | None,
        typer.Option(help="Only this action: requeue, skip, reclaim or republish."),
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many entries.", min=1)] = 50,
    as_json: JsonFlag = False,
) -> None:
    """List the operators' audit log, newest first: who requeued, skipped, reclaimed or
    republished what (from the CLI or the console), when, how many rows it changed, and why."""
    import sqlalchemy as sa

    from oncely.storage.stores import audit

    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            entries = audit.entries(conn, action=action, limit=limit)
    finally:
        engine.dispose()
    if as_json:
        print_json({"entries": entries})
        return
    table = Table("when (UTC)", "who", "via", "action", "target", "rows")
    table.add_column("reason", overflow="fold")
    for entry in entries:
        table.add_row(
            entry.at.isoformat(timespec="seconds"),
            escape(entry.actor),
            entry.via,
            entry.action,
            escape(entry.target),
            str(entry.rows),
            escape(entry.reason),
        )
    out.print(table)
    out.print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
