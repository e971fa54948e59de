"""``oncely healthcheck`` finds the process's own health port, whatever it is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry

from oncely.runtime import healthcheck
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


def test_a_port_of_another_protocol_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS listener answers an HTTP request with an alert record: not HTTP, so the check
    goes on to the next port (it raised http.client.BadStatusLine)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_like_tls() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            with connection:
                connection.recv(1024)
                connection.sendall(b"\x15\x03\x03\x00\x02\x02\x50")

    threading.Thread(target=answer_like_tls, daemon=True).start()
    server = HealthServer(
        registry=CollectorRegistry(), healthy=lambda: True, ready=lambda: False, port=0
    )
    server.start()
    tls_port = listener.getsockname()[1]
    monkeypatch.setattr(healthcheck, "listening_ports", lambda pid: [tls_port, server.port])
    try:
        assert check(pid=os.getpid()) == server.port
        with pytest.raises(HealthCheckError, match=rf":{tls_port}/readyz does not answer HTTP"):
            check(pid=os.getpid(), path="/readyz")
    finally:
        server.stop()
        listener.close()
