"""``oncely demo``: the payments example end to end, with faults, checked by invariants.

Run it from a checkout of the oncely repository (it drives ``examples/payments``). It starts a
local Kafka and PostgreSQL (the devstack) unless ``ONCELY_KAFKA_BOOTSTRAP_SERVERS`` and
``ONCELY_DATABASE_URL`` point at running ones.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Annotated

import typer

from oncely.cli._errors import ExitCode
from oncely.cli._imports import ImportTargetError, load_object
from oncely.cli._output import err, out


@contextlib.contextmanager
def _services() -> Iterator[tuple[str, str]]:
    from oncely.devstack import DevStack

    kafka = os.environ.get("ONCELY_KAFKA_BOOTSTRAP_SERVERS")
    database = os.environ.get("ONCELY_DATABASE_URL")
    if kafka and database:
        yield database, kafka
        return
    err.print("starting a local Kafka broker and PostgreSQL (oncely devstack) ...")
    with DevStack() as info:
        err.print(f"Kafka {info.kafka_version}, PostgreSQL {info.postgres_version}")
        yield info.database_url, info.kafka_bootstrap


app = typer.Typer()


@app.command(name="demo")
def run(
    events: Annotated[int, typer.Option(help="Transfers to request.")] = 5000,
    chaos: Annotated[
        bool, typer.Option(help="Kill the relay and a consumer mid-run, then replay a group.")
    ] = True,
    writers: Annotated[int, typer.Option(help="Writer threads.")] = 4,
    rate: Annotated[
        float,
        typer.Option(
            min=0,
            help="Transfers per second the writers offer, open loop (0: as fast as they can;"
            " on 2 cores that saturates the machine, and the latencies measure its queues).",
        ),
    ] = 50.0,
    keep_running: Annotated[
        bool, typer.Option(help="Leave the processes running after the checks (Ctrl-C stops).")
    ] = False,
) -> None:
    """Run the payments pipeline as separate processes and check its invariants.

    Relay, two consumer groups (send-receipt, ledger-projection) and a task worker run as
    `oncely` processes; writer threads request transfers at --rate (some retried with the same
    idempotency key). Exits 1 if an invariant fails.
    """
    try:
        demo = load_object("examples.payments.demo:run_demo")
        options_type = load_object("examples.payments.demo:Options")
    except ImportTargetError as exc:
        raise ImportTargetError(
            f"{exc}; run `oncely demo` from a checkout of the oncely repository: the demo drives "
            "examples/payments"
        ) from exc
    assert callable(demo) and callable(options_type)
    options = options_type(
        events=events, chaos=chaos, writers=writers, rate=rate, keep_running=keep_running
    )
    with _services() as (database_url, bootstrap):
        code = demo(database_url=database_url, bootstrap=bootstrap, options=options, console=out)
    raise typer.Exit(ExitCode.OK if code == 0 else ExitCode.FAILED)
