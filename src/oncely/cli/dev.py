"""``oncely dev up|down|status``: the local Kafka + PostgreSQL stack, without Docker."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from oncely.cli._output import err, out
from oncely.devstack import DevStack, default_stack_dir
from oncely.devstack.stack import read_state, stop_recorded, write_state
from oncely.errors import DevstackError

app = typer.Typer(help="Run a local Kafka broker and PostgreSQL (no Docker needed).")

StackDir = Annotated[
    Path,
    typer.Option(
        "--dir",
        envvar="ONCELY_DEVSTACK_DIR",
        help="Folder holding the stack's data and state.",
        default_factory=default_stack_dir,
        show_default="~/.cache/oncely/devstack",
    ),
]


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


@app.command()
def up(
    directory: StackDir,
    kafka_version: Annotated[
        str | None,
        typer.Option(
            envvar="ONCELY_DEVSTACK_KAFKA_VERSION", help="org.apache.kafka:kafka_2.13 version."
        ),
    ] = None,
) -> None:
    """Start the stack and keep it running until Ctrl-C or `oncely dev down`.

    Prints `export ONCELY_...` lines on stdout (for `eval`); everything else goes to stderr.
    Data lives in --dir while the stack runs and is deleted when it stops.
    """
    running = read_state(directory)
    if running is not None:
        err.print(
            f"[red]a stack already runs in {directory} (pid {running.supervisor_pid}).[/] "
            "Stop it with `oncely dev down` or pass another --dir."
        )
        raise typer.Exit(1)
    signal.signal(signal.SIGTERM, _raise_exit)
    stack = DevStack(directory=directory, kafka_version=kafka_version)
    try:
        err.print(f"starting Kafka and PostgreSQL in {directory} ...")
        try:
            info = stack.start()
        except DevstackError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(1) from None
        write_state(directory, info)
        sys.stdout.write(info.exports())
        sys.stdout.flush()
        err.print(
            f"[green]up[/]: Kafka {info.kafka_version} at {info.kafka_bootstrap}, "
            f"PostgreSQL {info.postgres_version} at {info.database_url}\n"
            "Ctrl-C or `oncely dev down` stops it."
        )
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
        err.print("stopped")


@app.command()
def down(directory: StackDir) -> None:
    """Stop the stack that `oncely dev up` runs in --dir (and delete its data)."""
    try:
        info = stop_recorded(directory)
    except DevstackError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    if info is None:
        out.print(f"no stack runs in {directory}")
    else:
        out.print(f"stopped Kafka at {info.kafka_bootstrap} and PostgreSQL at {info.database_url}")


@app.command()
def status(
    directory: StackDir,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for machines.")] = False,
) -> None:
    """Say whether a stack runs in --dir and how to reach it. Exit 1 when none runs."""
    info = read_state(directory)
    if as_json:
        sys.stdout.write(
            json.dumps({"running": info is not None, **(asdict(info) if info else {})}) + "\n"
        )
    elif info is None:
        out.print(f"no stack runs in {directory}")
    else:
        out.print(
            f"running (pid {info.supervisor_pid})\n"
            f"  Kafka {info.kafka_version} at {info.kafka_bootstrap} "
            f"(pid {info.kafka_pid}, log {info.kafka_log})\n"
            f"  PostgreSQL {info.postgres_version} at {info.database_url} "
            f"(pid {info.postgres_pid}, log {info.postgres_log})"
        )
    if info is None:
        raise typer.Exit(1)
