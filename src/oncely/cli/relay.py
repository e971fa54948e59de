"""``oncely relay run|purge``: the relay process and the retention purge."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from oncely.cli._options import (
    BootstrapServers,
    DatabaseUrl,
    Execute,
    LogFormatOption,
    LogLevelOption,
    OlderThan,
    parse_duration,
    settings_epilog,
    settings_with,
)
from oncely.cli._output import JsonFlag, out, print_dry_run, print_json, print_topic_purges
from oncely.runtime.logs import LogFormat, LogLevel, configure_logging
from oncely.settings import KafkaSettings, RelaySettings

app = typer.Typer(help="Publish staged outbox rows to Kafka.")


@app.command(epilog=settings_epilog(RelaySettings, "relay"))
def run(
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    owner_id: Annotated[
        str | None, typer.Option(help="Shard lease owner id (default hostname-pid-random).")
    ] = None,
    relay_id: Annotated[str | None, typer.Option(hidden=True)] = None,
    batch_size: Annotated[int | None, typer.Option(help="Rows read per page.")] = None,
    lease_seconds: Annotated[float | None, typer.Option(help="Shard lease.")] = None,
    max_attempts: Annotated[int | None, typer.Option(help="Failures before dead.")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics, /healthz, /readyz on this port.")
    ] = None,
    exactly_once: Annotated[
        bool | None,
        typer.Option(
            "--exactly-once",
            help="Publish each page in a Kafka transaction: no duplicate record for "
            "read_committed consumers (ONCELY_RELAY_EXACTLY_ONCE).",
            show_default=False,
        ),
    ] = None,
    log_format: LogFormatOption = LogFormat.JSON,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Run a relay until SIGTERM/SIGINT (then drain, give its shards back and exit 0).

    Several relays may run against the same table: they share the key shards under leases,
    per-key order holds, and a relay that lost a shard cannot record progress on it. Kafka security
    settings: ONCELY_KAFKA_SECURITY_PROTOCOL, ONCELY_KAFKA_SASL_*, ONCELY_KAFKA_SSL_CA_LOCATION,
    ONCELY_KAFKA_EXTRA. Exits 2 when Kafka refuses the credentials.
    """
    from oncely.relay.service import run_relay

    configure_logging(level=log_level, log_format=log_format)
    flags: dict[str, Any] = {
        "owner_id": owner_id,
        "relay_id": relay_id,
        "batch_size": batch_size,
        "lease_seconds": lease_seconds,
        "max_attempts": max_attempts,
        "metrics_port": metrics_port,
        "exactly_once": exactly_once,
    }
    settings = settings_with(RelaySettings, flags)
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers)
    run_relay(database_url=database_url, kafka=kafka, settings=settings)


@app.command()
def purge(
    database_url: DatabaseUrl,
    older_than: OlderThan = "7d",
    execute: Execute = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete published outbox rows older than --older-than, in batches.

    Only rows every shard's recorded progress has passed are deleted; rows of parked keys (a
    dead or delayed row and those held behind it) never are. A dry run unless --execute: it
    prints how many rows it would delete per topic, and the oldest of each.
    """
    import sqlalchemy as sa

    from oncely.storage.stores.outbox.relay import RelayStore

    horizon = parse_duration(older_than).total_seconds()
    engine = sa.create_engine(database_url)
    try:
        store = RelayStore(engine, owner="purge")
        if not execute:
            topics = store.purge_preview(older_than_seconds=horizon)
            total = sum(topic.rows for topic in topics)
            if as_json:
                print_json({"executed": False, "rows": total, "topics": topics})
                return
            print_topic_purges(
                f"would delete {total} published row(s) older than {older_than}", topics
            )
            print_dry_run()
            return
        deleted = store.purge(older_than_seconds=horizon)
    finally:
        engine.dispose()
    if as_json:
        print_json({"executed": True, "rows": deleted})
        return
    out.print(f"deleted {deleted} published row(s) older than {older_than}")
