"""``oncely consume module:effects --effect NAME``: run effect consumer groups."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from oncely.cli._imports import load_effects
from oncely.cli._options import (
    AppArgument,
    AppOption,
    BootstrapServers,
    DatabaseUrl,
    LogFormatOption,
    LogLevelOption,
    app_target,
    settings_epilog,
    settings_with,
)
from oncely.runtime.logs import LogFormat, LogLevel, configure_logging
from oncely.settings import ConsumerSettings, KafkaSettings, SchemaSettings

app = typer.Typer()


@app.command(name="consume", epilog=settings_epilog(ConsumerSettings, "consumer"))
def consume(
    app: AppArgument = None,
    *,
    app_option: AppOption = None,
    effect: Annotated[
        list[str], typer.Option("--effect", help="Effect to run (repeat for several).")
    ],
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    batch_size: Annotated[
        int | None, typer.Option(help="Records per transaction (ONCELY_CONSUMER_BATCH_SIZE).")
    ] = None,
    lanes: Annotated[
        int | None,
        typer.Option(
            min=1, help="Worker threads per effect; a key stays on one (ONCELY_CONSUMER_LANES)."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve /metrics, /healthz, /readyz on this port.")
    ] = None,
    schemas_dir: Annotated[
        Path | None,
        typer.Option(
            "--schemas-dir",
            envvar="ONCELY_SCHEMAS_DIR",
            help="The committed schema catalog (what `oncely schemas export` writes), to decode "
            "records written with other schema versions. Default: ./schemas when it exists.",
            show_default=False,
        ),
    ] = None,
    schema_registry_url: Annotated[
        str | None,
        typer.Option(
            "--schema-registry-url",
            envvar="ONCELY_SCHEMA_REGISTRY_URL",
            help="Confluent schema registry, needed by avro-confluent event types.",
            show_default=False,
        ),
    ] = None,
    log_format: LogFormatOption = LogFormat.JSON,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Apply events to effects, once each, one consumer group per effect.

    Each record's receipt (event id, effect) commits in the same transaction as the effect;
    the Kafka offset is committed after. SIGTERM commits what was applied and exits 0. A
    consumer without partitions for longer than ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS
    fails /readyz, and one left out of its group recreates its Kafka client. Kafka
    security settings: ONCELY_KAFKA_SECURITY_PROTOCOL, ONCELY_KAFKA_SASL_*,
    ONCELY_KAFKA_SSL_CA_LOCATION, ONCELY_KAFKA_EXTRA. At start it creates the effects'
    missing dead-letter topics <topic>.<effect>.dlq as `oncely topics ensure --effects` does
    (ONCELY_TOPICS_*: the source topic's partitions, replication factor, min.insync.replicas)
    and logs existing ones weaker than declared. Exits 2 when Kafka refuses the credentials, a
    dead-letter topic cannot be created, or the schema catalog is missing or disagrees with
    the code.

    Each record is decoded with its writer schema (by fingerprint in the catalog, or by id in
    the schema registry) and resolved to the code's version: new fields take their defaults,
    removed ones are dropped. A record whose writer schema is unknown is dead-lettered, and
    every dead-lettered record logs a WARNING with the reason and the fix.

    Every ONCELY_COMPLETENESS_INTERVAL_SECONDS (60; 0: never) it checks its effects'
    completeness and exports oncely_effect_missing_events{effect}: published events of their
    types older than ONCELY_COMPLETENESS_GRACE_SECONDS (300) with neither a receipt nor a dead
    letter.
    """
    from oncely.consumers.service import run_consumers
    from oncely.schemas.loader import codec_for

    configure_logging(level=log_level, log_format=log_format)
    loaded = load_effects(app_target(app, app_option))
    for name in effect:
        loaded.get(name)  # ConfigurationError naming the effects it has
    flags: dict[str, Any] = {"batch_size": batch_size, "lanes": lanes, "metrics_port": metrics_port}
    settings = settings_with(ConsumerSettings, flags)
    codec = codec_for(
        loaded.registry,
        SchemaSettings(schemas_dir=schemas_dir, schema_registry_url=schema_registry_url),
    )
    run_consumers(
        effects=loaded,
        names=effect,
        database_url=database_url,
        kafka=KafkaSettings(bootstrap_servers=bootstrap_servers),
        settings=settings,
        codec=codec,
    )
