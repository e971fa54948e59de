"""``oncely debezium config|purge|slot|drop-slot``: Debezium's Outbox Event Router as the relay.

Also defines :func:`connect`, the ``oncely dev connect`` command (a local Kafka Connect worker
with the generated connector, against the devstack or any broker and PostgreSQL).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from oncely import debezium
from oncely.cli._errors import ExitCode
from oncely.cli._options import (
    DatabaseUrl,
    Execute,
    OlderThan,
    check_database_url,
    parse_duration,
)
from oncely.cli._output import JsonFlag, err, out, print_dry_run, print_json, print_topic_purges
from oncely.devstack import default_stack_dir
from oncely.devstack.connect import DEFAULT_DEBEZIUM_VERSION, ConnectNode
from oncely.errors import ConfigurationError

app = typer.Typer(
    help="Relay the outbox with Debezium's Outbox Event Router instead of `oncely relay run`."
)

Schema = Annotated[
    str,
    typer.Option(envvar="ONCELY_DATABASE_SCHEMA", help="Schema holding oncely_outbox."),
]
Name = Annotated[str, typer.Option(help="The connector's name in Kafka Connect.")]
LogicalName = Annotated[
    str,
    typer.Option(
        help="Debezium's topic.prefix: names its metrics (unique per Connect worker); "
        "never part of the event topics."
    ),
]
TopicPrefix = Annotated[
    str, typer.Option(help="Put in front of every routed topic (default: the row's topic as is).")
]
RouteRegex = Annotated[
    str,
    typer.Option(
        help="Java regex matched against the whole topic column; its (?<routedByValue>...) "
        "group, after --topic-prefix, is the routed topic."
    ),
]
SlotName = Annotated[str, typer.Option(help="PostgreSQL replication slot of the connector.")]
PublicationName = Annotated[str, typer.Option(help="PostgreSQL publication of the connector.")]
ExtendedHeaders = Annotated[
    bool,
    typer.Option(
        help="Debezium's extended.headers.enabled: add __debezium.context.* headers before `id`."
    ),
]
CloudEventsSource = Annotated[
    str | None,
    typer.Option(
        envvar="ONCELY_RELAY_CLOUDEVENTS_SOURCE",
        help="Add the CloudEvents binary-mode headers (ce_id, ce_type, ce_time, ce_source, "
        "ce_specversion) with this ce_source, as `oncely relay run` does with the same variable.",
        show_default=False,
    ),
]


def _options(database_url: str, **options: Any) -> debezium.ConnectorOptions:
    return debezium.ConnectorOptions.from_database_url(database_url, **options)


@app.command()
def config(
    database_url: DatabaseUrl,
    output: Annotated[
        str,
        typer.Option(
            "--format",
            help="json: the body of POST /connectors; properties: ConnectStandalone's file.",
        ),
    ] = "json",
    schema: Schema = "public",
    name: Name = debezium.DEFAULT_CONNECTOR_NAME,
    logical_name: LogicalName = debezium.DEFAULT_LOGICAL_NAME,
    topic_prefix: TopicPrefix = "",
    route_regex: RouteRegex = debezium.DEFAULT_ROUTE_REGEX,
    slot_name: SlotName = debezium.DEFAULT_SLOT_NAME,
    publication_name: PublicationName = debezium.DEFAULT_PUBLICATION_NAME,
    extended_headers: ExtendedHeaders = False,
    cloudevents_source: CloudEventsSource = None,
) -> None:
    """Print the Debezium PostgreSQL connector configuration that relays oncely_outbox.

    The database URL is how Kafka Connect reaches PostgreSQL (e.g. `postgres:5432` inside
    docker compose); its password, if any, is written into the configuration. Register the JSON
    with `curl -X POST -H 'Content-Type: application/json' --data @oncely-outbox.json
    http://connect:8083/connectors`. Do not run `oncely relay run` as well. Traces continue
    through Debezium when Kafka Connect has the OpenTelemetry SDK (see docs/how-to/debezium.md).
    """
    if output not in ("json", "properties"):
        raise ConfigurationError(f"--format {output!r}: use json or properties")
    options = _options(
        database_url,
        schema=schema,
        name=name,
        logical_name=logical_name,
        topic_prefix=topic_prefix,
        route_regex=route_regex,
        slot_name=slot_name,
        publication_name=publication_name,
        extended_headers=extended_headers,
        cloudevents_source=cloudevents_source,
    )
    sys.stdout.write(debezium.render(options, "json" if output == "json" else "properties"))


def _print_purge_plan(plan: debezium.PurgePlan, heading: str) -> None:
    print_topic_purges(heading, plan.topics)
    if plan.waiting:
        out.print(
            f"  kept: {plan.waiting} older row(s) written by transactions still open at the "
            "mark (a later purge takes them)"
        )


@app.command()
def purge(
    database_url: DatabaseUrl,
    older_than: OlderThan = "7d",
    slot_name: Annotated[
        str | None,
        typer.Option(
            help="The connector's replication slot (default: the only logical replication "
            "slot of the database; refused when there are several).",
            show_default=False,
        ),
    ] = None,
    wait: Annotated[
        float,
        typer.Option(
            help="Seconds to wait for an active slot to confirm the purge's WAL position "
            "(Debezium confirms when it flushes offsets, every 60 s by default).",
            min=0,
        ),
    ] = 120.0,
    execute: Execute = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete outbox rows created before --older-than that the connector has read (Debezium mode).

    A dry run unless --execute: it prints the rows it would delete (count per topic, oldest
    row) and the slot's position, and deletes nothing. Debezium records no progress in the
    database, so `oncely relay purge` would keep its rows forever; this purge deletes them,
    but only those the connector's replication slot has confirmed: it records a mark
    (a snapshot's xmin, and the WAL insert position right after it), waits up to --wait seconds
    for the slot's confirmed_flush_lsn to reach that position, then deletes the old rows
    written before the snapshot. Rows written later stay for the next purge.

    Refused, deleting nothing, with exit 2 when there is no such slot, no logical slot at all
    (no connector reads this outbox, or `oncely relay` does), or several and no --slot-name;
    with exit 1 when the slot is inactive (no connector reads it) and behind, or did not catch
    up within --wait.
    """
    import sqlalchemy as sa

    horizon = parse_duration(older_than).total_seconds()
    engine = sa.create_engine(database_url)
    try:
        if not execute:
            plan = debezium.purge_plan(engine, older_than_seconds=horizon, slot_name=slot_name)
            if as_json:
                print_json({"executed": False, "plan": plan})
                return
            _print_purge_plan(
                plan, f"would delete {plan.rows} outbox row(s) created more than {older_than} ago"
            )
            slot = plan.slot
            state = "active" if slot.active else "inactive: no connector reads it"
            position = (
                "has confirmed it"
                if slot.passed
                else f"is {slot.behind_bytes} bytes behind it (--execute waits up to {wait:g} s"
                + (")" if slot.active else ", but refuses an inactive slot)")
            )
            out.print(
                f"slot {slot.name} is {state}; it confirmed {slot.confirmed_flush_lsn}, the purge "
                f"needs {plan.mark.lsn} and {position}"
            )
            print_dry_run()
            return
        result = debezium.purge(
            engine, older_than_seconds=horizon, slot_name=slot_name, wait_seconds=wait
        )
    finally:
        engine.dispose()
    if as_json:
        print_json({"executed": True, "deleted": result.deleted, "plan": result.plan})
        return
    _print_purge_plan(
        result.plan,
        f"deleted {result.deleted} outbox row(s) created more than {older_than} ago, all "
        f"confirmed by slot {result.slot.name} (at {result.slot.confirmed_flush_lsn})",
    )


@app.command("drop-slot")
def drop_slot(
    database_url: DatabaseUrl,
    slot_name: SlotName = debezium.DEFAULT_SLOT_NAME,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for a stopping connector to release it.")
    ] = 30.0,
) -> None:
    """Drop the connector's replication slot after the connector was deleted for good.

    An idle slot makes PostgreSQL keep all WAL from its position on. Exit 1 if the slot is
    still in use after --wait seconds.
    """
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    try:
        dropped = debezium.drop_slot(engine, slot_name, timeout=wait)
    finally:
        engine.dispose()
    out.print(f"dropped slot {slot_name}" if dropped else f"no slot {slot_name}")


@app.command()
def slot(
    database_url: DatabaseUrl,
    slot_name: SlotName = debezium.DEFAULT_SLOT_NAME,
    as_json: JsonFlag = False,
) -> None:
    """Show the connector's replication slot: held by a connector or idle, WAL it retains.

    Exit 1 when there is no such slot.
    """
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    try:
        status = debezium.slot_status(engine, slot_name)
    finally:
        engine.dispose()
    if as_json:
        sys.stdout.write(json.dumps(status, default=str) + "\n")
    elif status is None:
        out.print(f"no slot {slot_name}")
    else:
        state = "active" if status["active"] else "[yellow]idle[/] (retains WAL)"
        out.print(
            f"slot {slot_name} ({status['plugin']}, database {status['database']}): {state}, "
            f"{status['retained_wal_bytes']} bytes of WAL retained"
        )
    if status is None:
        raise typer.Exit(ExitCode.FAILED)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def connect(
    directory: Annotated[
        Path,
        typer.Option(
            "--dir",
            envvar="ONCELY_DEVSTACK_DIR",
            help="Folder of the `oncely dev up` stack whose settings are the defaults.",
            default_factory=default_stack_dir,
            show_default="~/.cache/oncely/devstack",
        ),
    ],
    database_url: Annotated[
        str | None,
        typer.Option(
            envvar="ONCELY_DATABASE_URL",
            help="Database holding oncely_outbox (default: the running `oncely dev up` stack's).",
            show_default=False,
            callback=check_database_url,
        ),
    ] = None,
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(
            "--bootstrap-servers",
            envvar="ONCELY_KAFKA_BOOTSTRAP_SERVERS",
            help="Kafka brokers (default: the running `oncely dev up` stack's).",
            show_default=False,
        ),
    ] = None,
    schema: Schema = "public",
    topic_prefix: TopicPrefix = "",
    route_regex: RouteRegex = debezium.DEFAULT_ROUTE_REGEX,
    slot_name: SlotName = debezium.DEFAULT_SLOT_NAME,
    publication_name: PublicationName = debezium.DEFAULT_PUBLICATION_NAME,
    debezium_version: Annotated[
        str, typer.Option(help="io.debezium:debezium-connector-postgres version.")
    ] = DEFAULT_DEBEZIUM_VERSION,
) -> None:
    """Run Kafka Connect + Debezium's outbox connector until Ctrl-C (instead of the relay).

    Resolves Kafka Connect and Debezium from Maven Central the first time (needs Java 17+ and
    Maven), starts a standalone worker whose REST API listens on 127.0.0.1, and registers the
    connector of `oncely debezium config`. On exit the worker stops and the replication slot is
    dropped, so the next run snapshots again every retained row oncely's relay has not
    published (consumers' receipts absorb the repeats). Do not run `oncely relay run` at the
    same time.
    """
    import sqlalchemy as sa

    from oncely.devstack.stack import read_state

    stack = read_state(directory)
    database_url = database_url or (stack.database_url if stack else None)
    bootstrap_servers = bootstrap_servers or (stack.kafka_bootstrap if stack else None)
    if database_url is None or bootstrap_servers is None:
        raise ConfigurationError(
            f"no stack runs in {directory}: start one with `oncely dev up`, or "
            "pass --database-url and --bootstrap-servers"
        )
    options = _options(
        database_url,
        schema=schema,
        topic_prefix=topic_prefix,
        route_regex=route_regex,
        slot_name=slot_name,
        publication_name=publication_name,
    )
    signal.signal(signal.SIGTERM, _raise_exit)
    data_dir = Path(tempfile.mkdtemp(prefix="oncely-connect-"))
    node = ConnectNode(
        data_dir=data_dir, bootstrap_servers=bootstrap_servers, debezium_version=debezium_version
    )
    engine = sa.create_engine(database_url)
    try:
        err.print("starting Kafka Connect with Debezium (the first run downloads it) ...")
        node.start()
        node.add_connector(options.name, debezium.connector_config(options))
        out.print(f"Kafka Connect REST API: {node.rest_url}")
        err.print(
            f"[green]up[/]: connector {options.name} relays {options.schema}.oncely_outbox "
            f"to {bootstrap_servers} (log {node.log_file}). Ctrl-C stops it."
        )
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
        try:
            debezium.drop_slot(engine, options.slot_name)
        except (debezium.SlotInUseError, sa.exc.SQLAlchemyError) as exc:
            err.print(f"[yellow]warning:[/] replication slot {options.slot_name} kept: {exc}")
        engine.dispose()
        shutil.rmtree(data_dir, ignore_errors=True)
        err.print("stopped")
