"""``oncely db upgrade|sql``: create and migrate oncely's tables; least-privilege GRANTs."""

from __future__ import annotations

from typing import Annotated, Any

import sqlalchemy as sa
import typer
from rich.markup import escape

from oncely.cli._options import DatabaseUrl
from oncely.cli._output import err, out
from oncely.errors import ConfigurationError
from oncely.storage.migrations import upgrade as apply_migrations
from oncely.storage.migrations import upgrade_sql
from oncely.storage.roles import grant_statements
from oncely.storage.tables import validate_schema_name

app = typer.Typer(help="Create and migrate oncely's tables in PostgreSQL.")

Schema = Annotated[
    str | None,
    typer.Option(envvar="ONCELY_DATABASE_SCHEMA", help="Schema for oncely's tables (created)."),
]


@app.command()
def upgrade(database_url: DatabaseUrl, schema: Schema = None) -> None:
    """Apply the migrations the database lacks (safe to run twice, and concurrently)."""
    try:
        if schema is not None:
            validate_schema_name(schema)  # before connecting: a bad name fails at once
    except ConfigurationError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    engine = sa.create_engine(database_url)
    try:
        applied = apply_migrations(engine, schema=schema)
    except ConfigurationError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except sa.exc.OperationalError as exc:
        err.print(f"[red]error:[/] cannot reach the database: {exc.orig}")
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    if applied:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
        out.print(f"applied {len(applied)} migration(s): {names}")
    else:
        out.print("up to date: no migration to apply")


def _role(component: str) -> Any:
    return typer.Option(f"--{component}", help=f"Role name of the {component} (with --roles).")


@app.command()
def sql(
    roles: Annotated[
        bool,
        typer.Option(
            "--roles",
            help="Print least-privilege GRANTs for the writer, relay and consumer roles "
            "(and the task worker with --task-worker, the operator with --operator) instead of "
            "the DDL.",
        ),
    ] = False,
    writer: Annotated[str, _role("writer")] = "oncely_writer",
    relay: Annotated[str, _role("relay")] = "oncely_relay",
    consumer: Annotated[str, _role("consumer")] = "oncely_consumer",
    task_worker: Annotated[
        str | None,
        typer.Option(help="Also print the task worker's GRANTs, for this role (with --roles)."),
    ] = None,
    operator: Annotated[
        str | None,
        typer.Option(
            help="Also print the operator's GRANTs (status, verify, dead, replay --from-outbox, "
            "purges, tasks reclaim), for this role (with --roles)."
        ),
    ] = None,
    schema: Annotated[
        str,
        typer.Option(
            envvar="ONCELY_DATABASE_SCHEMA", help="Schema of oncely's tables (with --roles)."
        ),
    ] = "public",
) -> None:
    """Print the DDL `oncely db upgrade` runs, for DBAs who apply it themselves.

    With --roles: the GRANTs each component needs, derived from the SQL it runs (create the
    roles first). Exits 2 for a role or schema name that is not a plain identifier.
    """
    if not roles:
        typer.echo(upgrade_sql(), nl=False)
        return
    names = {"writer": writer, "relay": relay, "consumer": consumer}
    if task_worker is not None:
        names["task_worker"] = task_worker
    if operator is not None:
        names["operator"] = operator
    try:
        text = grant_statements(names, schema=schema)
    except ConfigurationError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    typer.echo(text, nl=False)
