"""``oncely db upgrade|sql``: create and migrate oncely's tables; least-privilege GRANTs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from oncely.cli._options import DatabaseUrl
from oncely.cli._output import out

app = typer.Typer(help="Create and migrate oncely's tables in PostgreSQL.")

Schema = Annotated[
    str | None,
    typer.Option(envvar="ONCELY_DATABASE_SCHEMA", help="Schema for oncely's tables (created)."),
]


Shards = Annotated[
    int | None,
    typer.Option(
        help="Number of key shards the relay reads by (1-1024, default 32). Only meaningful on "
        "the upgrade that applies migration 0003 (a new installation, or the upgrade to the "
        "log-reading relay): the count is fixed then. At most one relay reads a shard at a "
        "time, so choose at least as many shards as relays you will run.",
    ),
]


PartitionEvery = Annotated[
    str | None,
    typer.Option(
        "--partition-every",
        help="Convert the outbox and the receipts into tables partitioned by time, one "
        "partition per step (e.g. 1d, 6h, 15m; aligned to the Unix epoch), so that "
        "`oncely retention run` drops whole partitions instead of deleting rows. Every row is "
        "copied, and both tables are locked for writes until the upgrade commits: staging and "
        "consuming pause that long (the documented pause). The step cannot change later; "
        "tables already partitioned by it are left as they are.",
        show_default=False,
    ),
]


@app.command()
def upgrade(
    database_url: DatabaseUrl,
    schema: Schema = None,
    shards: Shards = None,
    partition_every: PartitionEvery = None,
) -> None:
    """Apply the migrations the database lacks (safe to run twice, and concurrently).

    Upgrading a database from before migration 0003: stop every relay first (the upgrade
    refuses while their row leases are live); rows pending then are published once by the new
    relay, and dead rows keep their keys parked (`oncely dead list`).
    """
    import sqlalchemy as sa

    from oncely.storage import partitions
    from oncely.storage.migrations import upgrade as apply_migrations
    from oncely.storage.migrations import validate_shards
    from oncely.storage.tables import validate_schema_name

    if schema is not None:
        validate_schema_name(schema)  # before connecting: a bad name fails at once
    if shards is not None:
        validate_shards(shards)
    step = None if partition_every is None else partitions.parse_step(partition_every)
    engine = sa.create_engine(database_url)
    try:
        before = _partitioned(engine, schema) if step is not None else {}
        applied = apply_migrations(engine, schema=schema, shards=shards, partition_every=step)
        after = _partitioned(engine, schema) if step is not None else {}
    finally:
        engine.dispose()
    if applied:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied)
        out.print(f"applied {len(applied)} migration(s): {names}")
    else:
        out.print("up to date: no migration to apply")
    if partition_every is None:
        return
    converted = {table: n for table, n in after.items() if table not in before}
    for table, count in converted.items():
        out.print(f"converted {table}: {count} partition(s) of {partition_every}")
    if not converted:
        out.print(f"already partitioned by {partition_every}: nothing to convert")


def _partitioned(engine: Any, schema: str | None) -> dict[str, int]:
    """The outbox's and the receipts' range partitions by table; empty while they are not
    partitioned (:func:`~oncely.storage.partitions.step_of`)."""
    import sqlalchemy as sa

    from oncely.storage import partitions

    with engine.connect() as conn:
        if schema is not None:
            conn.execute(sa.text("SELECT set_config('search_path', :s, false)"), {"s": schema})
        if partitions.step_of(conn) is None:
            return {}
        return {
            table: sum(1 for p in partitions.partitions(conn, table) if not p.is_default)
            for table in partitions.PARTITION_KEYS
        }


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
            "purges, tasks reclaim, the console with its actions), for this role (with --roles)."
        ),
    ] = None,
    console: Annotated[
        str | None,
        typer.Option(
            help="Also print the read-only console's GRANTs (`oncely web` with "
            "ONCELY_WEB_READ_ONLY=true: SELECT only), for this role (with --roles)."
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

    Run it in one transaction; migration 0003 takes the shard count from
    `SET LOCAL oncely.shards = N` earlier in that transaction (default 32).

    With --roles: the GRANTs each component needs, derived from the SQL it runs (create the
    roles first). Exits 2 for a role or schema name that is not a plain identifier.
    """
    from oncely.storage.migrations import upgrade_sql
    from oncely.storage.roles import grant_statements

    if not roles:
        typer.echo(upgrade_sql(), nl=False)
        return
    names = {"writer": writer, "relay": relay, "consumer": consumer}
    if task_worker is not None:
        names["task_worker"] = task_worker
    if operator is not None:
        names["operator"] = operator
    if console is not None:
        names["console"] = console
    text = grant_statements(names, schema=schema)
    typer.echo(text, nl=False)
