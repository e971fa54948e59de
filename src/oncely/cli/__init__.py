"""The ``oncely`` command line: one typer app with a sub-app per area.

Each area's module is imported when its command runs (or its help is shown), so a command
starts without loading the others; ``oncely --help`` lists them from :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, MutableMapping
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from oncely.cli._errors import run
from oncely.cli._output import out

#: Each command -> its module (in ``oncely.cli``) and its one-line help. The module defines
#: ``app``: a typer app, the group of that name's commands, or (:data:`SINGLE`) the command.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "Run the payments pipeline as separate processes and check its invariants."),
    "consume": ("consume", "Apply events to effects, once each, one consumer group per effect."),
    "replay": (
        "replay",
        "Replay safely: receipts keep effects single, so re-reading never applies twice.",
    ),
    "status": (
        "status",
        "Show the outbox backlog per topic and shard, parked keys, shard leases, each effect's "
        "lag, receipts and DLQ, and tasks by state.",
    ),
    "verify": (
        "verify",
        "Reconcile a window of outbox rows with Kafka and the effects' receipts (read-only).",
    ),
    "asyncapi": (
        "asyncapi",
        "Write the AsyncAPI 3.0 document of the application's events and effects, as JSON.",
    ),
    "db": ("db", "Create and migrate oncely's tables in PostgreSQL."),
    "dead": (
        "dead",
        "Inspect, requeue or skip dead outbox rows, or delayed ones named by id (each parks "
        "its key; a running relay carries out requeue and skip).",
    ),
    "debezium": (
        "debezium",
        "Relay the outbox with Debezium's Outbox Event Router instead of `oncely relay run`.",
    ),
    "healthcheck": (
        "healthcheck",
        "Exit 0 when this container's oncely process answers /healthz: the image's HEALTHCHECK.",
    ),
    "dev": ("dev", "Run a local Kafka broker and PostgreSQL (no Docker needed)."),
    "receipts": ("receipts", "Effect receipts: the evidence that keeps effects single."),
    "relay": ("relay", "Publish staged outbox rows to Kafka."),
    "retention": (
        "retention",
        "Drop partitions of the partitioned outbox and receipts that nothing can need again.",
    ),
    "schemas": (
        "schemas",
        "Export event schemas to the committed catalog, check changes against it, and register "
        "it in a schema registry.",
    ),
    "tasks": (
        "tasks",
        "Run durable tasks (emails, webhooks, API calls) and manage stale and dead ones.",
    ),
    "topics": ("topics", "Provision Kafka topics for the registered event types."),
    "web": (
        "web",
        "Serve the console: the pipeline's state, any event end to end, and the operator's "
        "actions (requeue, skip, reclaim, republish), each shown as a dry run first and audited.",
    ),
    "audit": (
        "audit",
        "List the operators' audit log, newest first: who requeued, skipped, reclaimed or "
        "republished what (from the CLI or the console), when, how many rows it changed, and why.",
    ),
}


#: The commands that are one command, not a group of subcommands.
SINGLE = frozenset(
    {"asyncapi", "audit", "demo", "consume", "healthcheck", "replay", "status", "verify", "web"}
)


def load_command(name: str) -> Any:
    """The (click) command ``oncely NAME``, its module imported."""
    module = importlib.import_module(f"oncely.cli.{COMMANDS[name][0]}")
    make = typer.main.get_command if name in SINGLE else typer.main.get_group
    command = make(module.app)
    command.name = name
    return command


class _Commands(MutableMapping[str, Any]):
    """The root's subcommands by name, each loaded on first use; while the root's help is
    written, a stub with the command's one-line help stands in (nothing is imported)."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}
        self.listing = False

    def __getitem__(self, name: str) -> Any:
        if name not in COMMANDS:
            raise KeyError(name)
        if self.listing and name not in self._loaded:
            return TyperCommand(name=name, help=COMMANDS[name][1])
        if name not in self._loaded:
            self._loaded[name] = load_command(name)
        return self._loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        raise TypeError("oncely's commands are fixed")

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class _Root(TyperGroup):
    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._lazy = _Commands()
        self.commands = self._lazy

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._lazy.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._lazy.listing = False


app = typer.Typer(
    name="oncely",
    cls=_Root,
    help="Transactional outbox to Kafka to effects: no committed event lost, no effect twice.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from oncely import __version__

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


def main() -> None:
    """Entry point of the ``oncely`` console script: every error a user can cause is one line
    on stderr (:mod:`oncely.cli._errors`)."""
    sys.exit(run(app, sys.argv[1:]))
