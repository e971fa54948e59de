"""``oncely db upgrade|sql``: create and migrate oncely's tables."""

from __future__ import annotations

from typing import Annotated

import sqlalchemy as sa
import typer

from oncely.cli._options import DatabaseUrl
from oncely.cli._output import err, out
from oncely.errors import ConfigurationError
from oncely.storage.migrations import upgrade as apply_migrations
from oncely.storage.migrations import upgrade_sql

app = typer.Typer(help="Create and migrate oncely's tables in PostgreSQL.")

Schema = Annotated[
    str | None,
    typer.Option(envvar="ONCELY_DATABASE_SCHEMA", help="Schema for oncely's tables (created)."),
]


@app.command()
def upgrade(database_url: DatabaseUrl, schema: Schema = None) -> None:
    """Apply the migrations the database lacks (safe to run twice, and concurrently)."""
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


@app.command()
def sql() -> None:
    """Print the DDL `oncely db upgrade` runs, for DBAs who apply it themselves."""
    typer.echo(upgrade_sql(), nl=False)
