"""``oncely topics ensure``: create the event types' topics, report weaker existing ones."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from oncely.cli._errors import ExitCode
from oncely.cli._imports import load_app, load_effects
from oncely.cli._kafka import reached
from oncely.cli._options import APP_HELP, BootstrapServers
from oncely.cli._output import JsonFlag, out, print_json
from oncely.settings import RelaySettings, TopicSettings

app = typer.Typer(help="Provision Kafka topics for the registered event types.")


@app.command()
def ensure(
    registry: Annotated[
        str,
        typer.Option("--app", "--registry", envvar="ONCELY_APP", help=APP_HELP, show_default=False),
    ],
    bootstrap_servers: BootstrapServers,
    effects: Annotated[
        list[str] | None,
        typer.Option(
            "--effects",
            help="An effects app (module:attribute) whose dead-letter topics to provision too; "
            "repeat for several.",
        ),
    ] = None,
    partitions: Annotated[
        int | None, typer.Option(help="Partitions (env ONCELY_TOPICS_PARTITIONS, default 6).")
    ] = None,
    replication_factor: Annotated[
        int | None,
        typer.Option(
            help="Replicas (env ONCELY_TOPICS_REPLICATION_FACTOR, default 1; production: 3)."
        ),
    ] = None,
    min_insync_replicas: Annotated[
        int | None,
        typer.Option(
            help="min.insync.replicas (env ONCELY_TOPICS_MIN_INSYNC_REPLICAS, default 1; "
            "production: 2)."
        ),
    ] = None,
    exactly_once: Annotated[
        bool | None,
        typer.Option(
            "--exactly-once/--at-least-once",
            help="Also the progress topic of relays in exactly-once mode, <prefix>.progress "
            "(ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX; default: ONCELY_RELAY_EXACTLY_ONCE).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create missing topics; exit 1 if an existing topic is weaker than declared.

    The App's effects (an App with effects=, or an Effects object) and those of --effects get
    their dead-letter topics <topic>.<effect>.dlq too, each declared as its source topic
    (partitions, replication factor, min.insync.replicas, overrides). The options set every
    topic; ONCELY_TOPICS_OVERRIDES (JSON) sets some event types apart,
    e.g. '{"transfer.completed": {"partitions": 24}}'. Weaker means fewer partitions or
    replicas, a lower min.insync.replicas, min.insync.replicas above the replicas, or unclean
    leader election enabled. A topic deleted or created by someone else meanwhile is planned
    again; one that keeps changing is reported as failed. Exit 1 as well when a topic cannot
    be created (e.g. more replicas than brokers) or Kafka cannot be reached, 2 for a wrong
    application or settings.
    """
    from confluent_kafka.admin import AdminClient

    from oncely.topics import ensure_topics, planned_topics, progress_topic_spec

    loaded = load_app(registry)
    apps = [app for app in [loaded.effects] if app is not None]
    apps += [load_effects(target) for target in effects or []]
    event_registry = loaded.require_registry(registry)
    flags: dict[str, Any] = {
        "partitions": partitions,
        "replication_factor": replication_factor,
        "min_insync_replicas": min_insync_replicas,
    }
    settings = TopicSettings(**{k: v for k, v in flags.items() if v is not None})
    specs = planned_topics(event_registry, settings, effects=[e for app in apps for e in app])
    relay = RelaySettings()
    if relay.exactly_once if exactly_once is None else exactly_once:
        specs.append(progress_topic_spec(relay.transactional_id_prefix, settings))
    admin = AdminClient(reached(bootstrap_servers).client_config())
    report = ensure_topics(admin, specs)
    declared = {spec.name: spec for spec in specs}
    if as_json:
        print_json(
            {
                "created": report.created,
                "matching": report.matching,
                "mismatches": report.mismatches,
                "failed": report.failed,
            }
        )
        if report.mismatches or report.failed:
            raise typer.Exit(ExitCode.FAILED)
        return
    for name in report.created:
        out.print(f"created   {name} ({declared[name].describe()})", highlight=False)
    for name in report.matching:
        out.print(f"ok        {name}", highlight=False)
    for problem in report.mismatches:
        out.print(f"[red]mismatch[/]  {problem}", highlight=False)
    for problem in report.failed:
        out.print(f"[red]failed[/]    {problem}", highlight=False)
    if report.mismatches or report.failed:
        raise typer.Exit(ExitCode.FAILED)
