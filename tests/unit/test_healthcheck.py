"""``oncely healthcheck`` finds the process's own health port, whatever it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from oncely.runtime.healthcheck import HealthCheckError, check
from oncely.runtime.http import HealthServer


@pytest.mark.parametrize("healthy", [True, False])
def test_the_check_asks_the_port_the_process_serves(healthy: bool) -> None:
    server = HealthServer(
        registry=CollectorRegistry(), healthy=lambda: healthy, ready=lambda: False, port=0
    )
    server.start()
    try:
        if healthy:
            assert check(pid=os.getpid()) == server.port
        with pytest.raises(
            HealthCheckError, match=rf":{server.port}/(healthz|readyz) answered 503"
        ):
            check(pid=os.getpid(), path="/healthz" if not healthy else "/readyz")
    finally:
        server.stop()


def test_a_process_that_serves_no_port_is_not_healthy() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as child:
        try:
            with pytest.raises(HealthCheckError, match="listens on no TCP port"):
                check(pid=child.pid)
        finally:
            child.kill()
