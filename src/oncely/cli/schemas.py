"""``oncely schemas export|check|register``: the committed Avro contract of an application's
events, and its copy in a Confluent-compatible schema registry.

Exit codes: 0 success; 1 a check found incompatibilities, export refused to rewrite a committed
version, the registry refused a version or could not be reached; 2 the command could not run
(bad ``--app``, unreadable catalog, no registry URL).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from oncely.cli._errors import ExitCode
from oncely.cli._imports import load_registry
from oncely.cli._options import APP_HELP
from oncely.cli._output import JsonFlag, err, out, print_json
from oncely.schemas.compatibility import CompatibilityMode, check_compatibility

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    from oncely.schemas.registration import RegistryVerdict

app = typer.Typer(
    help="Export event schemas to the committed catalog, check changes against it, and "
    "register it in a schema registry.",
    no_args_is_help=True,
)

RegistryTarget = Annotated[
    str,
    typer.Option(
        "--app",
        "--registry",
        envvar=["ONCELY_APP", "ONCELY_REGISTRY"],
        help=APP_HELP,
        show_default=False,
    ),
]
SchemaRegistryUrl = Annotated[
    str | None,
    typer.Option(
        "--schema-registry-url",
        envvar="ONCELY_SCHEMA_REGISTRY_URL",
        help="Confluent-compatible schema registry (credentials and TLS files: "
        "ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO, ONCELY_SCHEMA_REGISTRY_SSL_*).",
        show_default=False,
    ),
]
CatalogDir = Annotated[
    Path,
    typer.Option("--dir", envvar="ONCELY_SCHEMAS_DIR", help="The committed catalog folder."),
]


def _registry_client(url: str | None) -> SchemaRegistryClient:
    """The schema registry client of ``url`` and the ``ONCELY_SCHEMA_REGISTRY_*`` settings."""
    from oncely.schemas.loader import schema_registry_client
    from oncely.settings import SchemaSettings

    return schema_registry_client(SchemaSettings(schema_registry_url=url))


@app.command()
def export(
    registry: RegistryTarget,
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out", envvar="ONCELY_SCHEMAS_DIR", help="Catalog folder: <type>/v<N>.avsc."
        ),
    ] = Path("schemas"),
) -> None:
    """Write each event type's schema to <out>/<event-type>/v<N>.avsc.

    Never rewrites a committed version with other content: if any would change, nothing is
    written and the command exits 1 naming the files.
    """
    from oncely.schemas.catalog import export_schemas

    event_registry = load_registry(registry)
    outcomes = export_schemas(event_registry, out_dir)
    for path, outcome in outcomes:
        out.print(f"{outcome.value:9} {escape(str(path))}", highlight=False)


@app.command()
def check(
    registry: RegistryTarget,
    directory: CatalogDir = Path("schemas"),
    mode: Annotated[
        CompatibilityMode,
        typer.Option(
            "--mode",
            envvar="ONCELY_SCHEMAS_MODE",
            case_sensitive=False,
            help="BACKWARD: new code reads old data; FORWARD: old code reads new data; FULL: both.",
        ),
    ] = CompatibilityMode.FULL,
    transitive: Annotated[
        bool,
        typer.Option(
            "--transitive",
            envvar="ONCELY_SCHEMAS_TRANSITIVE",
            help="Compare with every older committed version, not only the latest.",
        ),
    ] = False,
    schema_registry_url: SchemaRegistryUrl = None,
    as_json: JsonFlag = False,
) -> None:
    """Check the code's schemas against the committed versions; exit 1 on any break.

    Each incompatibility is printed with the versions involved and its location in the reader
    schema. With a schema registry, the registry's compatibility endpoint is also asked about
    the code's schema of each avro-confluent event type, against the latest version of its
    subject under the registry's compatibility level for it.
    """
    from oncely.schemas.catalog import SchemaCatalog

    event_registry = load_registry(registry)
    catalog = SchemaCatalog.load(directory)
    found = check_compatibility(event_registry, catalog, mode=mode, transitive=transitive)
    verdicts: list[RegistryVerdict] | None = None
    if schema_registry_url is not None:
        from oncely.schemas.registration import check_registry

        verdicts = check_registry(_registry_client(schema_registry_url), event_registry)
    refused = [v for v in verdicts or [] if v.compatible is False]
    if as_json:
        print_json(
            {
                "compatible": not found,
                "mode": mode.value,
                "transitive": transitive,
                "event_types": [
                    {
                        "event_type": t.name,
                        "version": t.version,
                        "committed": [e.version for e in catalog.versions(t.name)],
                    }
                    for t in event_registry
                ],
                "incompatibilities": found,
                "schema_registry": verdicts,
            }
        )
        if found or refused:
            raise typer.Exit(ExitCode.FAILED)
        return
    for problem in found:
        out.print(f"BREAK {escape(str(problem))}", highlight=False)
    for verdict in refused:
        out.print(
            f"BREAK {escape(verdict.event_type)}: the schema registry finds v{verdict.version} "
            f"(code) incompatible with the latest version of subject {escape(verdict.subject)} "
            "(under the subject's compatibility level)",
            highlight=False,
        )
    scope = "all older versions" if transitive else "the latest older version"
    if found or refused:
        if found:
            err.print(f"[red]{len(found)} incompatibilities[/] ({mode.value}, against {scope})")
        if refused:
            err.print(f"[red]{len(refused)} refused by the schema registry[/]")
        raise typer.Exit(ExitCode.FAILED)
    for event_type in event_registry:
        versions = [entry.version for entry in catalog.versions(event_type.name)]
        committed = ", ".join(f"v{version}" for version in versions) or "nothing committed"
        out.print(
            f"ok    {escape(event_type.name)} v{event_type.version} ({committed})", highlight=False
        )
    for verdict in verdicts or []:
        held = "compatible with its latest version" if verdict.compatible else "no version yet"
        out.print(
            f"ok    {escape(verdict.event_type)} v{verdict.version} in the schema registry "
            f"(subject {escape(verdict.subject)}: {held})",
            highlight=False,
        )
    err.print(f"[green]compatible[/] ({mode.value}, against {scope})")


@app.command()
def register(
    registry: RegistryTarget,
    directory: CatalogDir = Path("schemas"),
    schema_registry_url: SchemaRegistryUrl = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Look each version up and register nothing."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Register every committed version of each avro-confluent event type in the schema
    registry, oldest first, under the subject <topic>-value: a deploy step, run before the code
    that stages a new version (stage() only looks schema ids up).

    Prints each version's schema id; a version already registered keeps its id, so running it
    again changes nothing. Exits 1 when the registry refuses a version as incompatible (the
    versions before it stay registered) or cannot be reached, 2 when the code's version of an
    event type is not in the catalog (run `oncely schemas export`).
    """
    from oncely.schemas.catalog import SchemaCatalog
    from oncely.schemas.registration import RegistrationResult, confluent_types, register_catalog

    event_registry = load_registry(registry)
    catalog = SchemaCatalog.load(directory)
    if not confluent_types(event_registry):
        if as_json:
            print_json({"dry_run": dry_run, "registrations": []})
        err.print(f"no avro-confluent event types in {escape(registry)}: nothing to register")
        return
    client = _registry_client(schema_registry_url)
    done = []
    for item in register_catalog(client, event_registry, catalog, dry_run=dry_run):
        done.append(item)
        if not as_json:
            schema_id = f"id {item.schema_id}" if item.schema_id is not None else "no id"
            out.print(
                f"{item.outcome.value:10} {escape(item.event_type)} v{item.version} "
                f"(subject {escape(item.subject)}, {schema_id})",
                highlight=False,
            )
    if as_json:
        print_json({"dry_run": dry_run, "registrations": done})
        return
    new = sum(item.outcome is RegistrationResult.REGISTERED for item in done)
    missing = sum(item.outcome is RegistrationResult.MISSING for item in done)
    if dry_run:
        err.print(
            f"dry run: nothing registered; {missing} version(s) to register "
            "(run again without --dry-run)"
        )
    else:
        err.print(f"[green]{new} registered[/], {len(done) - new} already registered")
