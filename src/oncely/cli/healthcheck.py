"""``oncely healthcheck``: the image's ``HEALTHCHECK``, for the relay, consumers and task workers.

Exit codes: 0 the process answered 200; 1 it did not, or serves no health port.
"""

from __future__ import annotations

from typing import Annotated

import typer

from oncely.cli._output import out
from oncely.runtime.healthcheck import check

app = typer.Typer()


@app.command(name="healthcheck")
def healthcheck(
    path: Annotated[
        str, typer.Option(help="The endpoint to ask: /healthz or /readyz.")
    ] = "/healthz",
    pid: Annotated[
        int, typer.Option(help="The process whose ports to ask (and its children).")
    ] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer.")] = 5.0,
) -> None:
    """Exit 0 when this container's oncely process answers /healthz: the image's HEALTHCHECK.

    It asks PID 1 (and its children) on every TCP port they listen on, so one health check fits
    a relay, a consumer and a task worker started with any --metrics-port.
    """
    port = check(pid=pid, path=path, timeout=timeout)
    out.print(f"{path} answered 200 on port {port}", highlight=False)
