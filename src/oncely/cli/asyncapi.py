"""``oncely asyncapi``: the application's events as an AsyncAPI 3.0 document.

Exit codes: 0 written (or, with ``--check``, up to date); 1 ``--check`` found the file stale
or missing; 2 the command could not run (bad ``--app``, ``--check`` without ``--output``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from oncely.cli._imports import load_app
from oncely.cli._options import RequiredApp
from oncely.cli._output import out
from oncely.errors import OncelyError

app = typer.Typer()


@app.command()
def asyncapi(
    target: RequiredApp,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            envvar="ONCELY_ASYNCAPI_OUTPUT",
            help="Write the document to this file (default: print it).",
            show_default=False,
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Write nothing; exit 1 if the --output file differs from the document (a "
            "stale committed copy).",
        ),
    ] = False,
    title: Annotated[
        str | None,
        typer.Option(
            "--title",
            envvar="ONCELY_ASYNCAPI_TITLE",
            help="The document's info.title (default: the --app module's name).",
            show_default=False,
        ),
    ] = None,
    api_version: Annotated[
        str,
        typer.Option(
            "--api-version",
            envvar="ONCELY_ASYNCAPI_VERSION",
            help="The document's info.version: the version of the application's event API.",
        ),
    ] = "1.0.0",
) -> None:
    """Write the AsyncAPI 3.0 document of the application's events and effects, as JSON.

    A channel per topic; a message per event type with its payload schema (Avro, or JSON Schema
    for JSON-encoded types), its headers and its key; a send operation per event type and a
    receive operation per effect and event type, with the effect's consumer group.
    """
    from oncely.ops.asyncapi import asyncapi_document, render

    if check and output is None:
        raise typer.BadParameter("name the committed file to compare with", param_hint="--check")
    application = load_app(target)
    document = asyncapi_document(
        registry=application.require_registry(target),
        effects=application.effects,
        title=title if title is not None else target.partition(":")[0],
        version=api_version,
    )
    text = render(document)
    if output is None:
        typer.echo(text, nl=False)
        return
    if check:
        current = output.read_text(encoding="utf-8") if output.is_file() else None
        if current != text:
            state = "missing" if current is None else "stale"
            raise OncelyError(
                f"{output} is {state}: run the same command without --check and commit the file"
            )
        out.print(f"up to date {escape(str(output))}", highlight=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    out.print(f"wrote {escape(str(output))}", highlight=False)
