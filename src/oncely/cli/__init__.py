"""The ``oncely`` command line: one typer app with a sub-app per area."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from oncely import __version__
from oncely.cli import (
    consume,
    db,
    dead,
    debezium,
    demo,
    dev,
    receipts,
    relay,
    replay,
    schemas,
    status,
    tasks,
    topics,
    verify,
)
from oncely.cli._errors import run
from oncely.cli._options import settings_epilog
from oncely.cli._output import out
from oncely.settings import ConsumerSettings

app = typer.Typer(
    name="oncely",
    help="Transactional outbox to Kafka to effects: no committed event lost, no effect twice.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        out.print(f"oncely {__version__}", highlight=False)
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print oncely's version and exit."
        ),
    ] = False,
) -> None:
    """Transactional outbox to Kafka to effects: no committed event lost, no effect twice."""


app.add_typer(db.app, name="db")
app.add_typer(dead.app, name="dead")
app.add_typer(debezium.app, name="debezium")
app.add_typer(dev.app, name="dev")
app.add_typer(receipts.app, name="receipts")
app.add_typer(relay.app, name="relay")
app.add_typer(schemas.app, name="schemas")
app.add_typer(tasks.app, name="tasks")
app.add_typer(topics.app, name="topics")
app.command(name="demo")(demo.run)
app.command(name="consume", epilog=settings_epilog(ConsumerSettings, "consumer"))(consume.consume)
app.command(name="replay")(replay.replay)
app.command(name="status")(status.status)
app.command(name="verify")(verify.verify)


def main() -> None:
    """Entry point of the ``oncely`` console script: every error a user can cause is one line
    on stderr (:mod:`oncely.cli._errors`)."""
    sys.exit(run(app, sys.argv[1:]))
