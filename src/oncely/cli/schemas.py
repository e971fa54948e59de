"""``oncely schemas export|check``: the committed Avro contract of an application's events.

Exit codes: 0 success; 1 a check found incompatibilities or export refused to rewrite a
committed version; 2 the command could not run (bad ``--app``, unreadable catalog).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from oncely.cli._imports import load_registry
from oncely.cli._options import APP_HELP
from oncely.cli._output import JsonFlag, err, out, print_json
from oncely.schemas.compatibility import CompatibilityMode, check_compatibility

app = typer.Typer(
    help="Export event schemas to the committed catalog and check changes against it.",
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
_BROKEN = 1
_CANNOT_RUN = 2


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
    from oncely.schemas.errors import CatalogError

    event_registry = load_registry(registry)
    try:
        outcomes = export_schemas(event_registry, out_dir)
    except CatalogError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(_BROKEN) from None
    for path, outcome in outcomes:
        out.print(f"{outcome.value:9} {escape(str(path))}", highlight=False)


@app.command()
def check(
    registry: RegistryTarget,
    directory: Annotated[
        Path,
        typer.Option("--dir", envvar="ONCELY_SCHEMAS_DIR", help="The committed catalog folder."),
    ] = Path("schemas"),
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
    as_json: JsonFlag = False,
) -> None:
    """Check the code's schemas against the committed versions; exit 1 on any break.

    Each incompatibility is printed with the versions involved and its location in the reader
    schema.
    """
    from oncely.schemas.catalog import SchemaCatalog
    from oncely.schemas.errors import CatalogError

    event_registry = load_registry(registry)
    try:
        catalog = SchemaCatalog.load(directory)
    except CatalogError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(_CANNOT_RUN) from None
    found = check_compatibility(event_registry, catalog, mode=mode, transitive=transitive)
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
            }
        )
        if found:
            raise typer.Exit(_BROKEN)
        return
    for problem in found:
        out.print(f"BREAK {escape(str(problem))}", highlight=False)
    scope = "all older versions" if transitive else "the latest older version"
    if found:
        err.print(f"[red]{len(found)} incompatibilities[/] ({mode.value}, against {scope})")
        raise typer.Exit(_BROKEN)
    for event_type in event_registry:
        versions = [entry.version for entry in catalog.versions(event_type.name)]
        committed = ", ".join(f"v{version}" for version in versions) or "nothing committed"
        out.print(
            f"ok    {escape(event_type.name)} v{event_type.version} ({committed})", highlight=False
        )
    err.print(f"[green]compatible[/] ({mode.value}, against {scope})")
