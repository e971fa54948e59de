"""Waiting for a condition, and the HTTP endpoints (health, metrics) of a running process."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request


def wait_until(predicate: object, *, timeout: float, interval: float = 0.1) -> None:
    """Return once ``predicate()`` is true, asking every ``interval`` seconds; fail after
    ``timeout``. Each wait overshoots by half an interval on average (it was 0.2 s: a make test
    run has well over a thousand waits)."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        time.sleep(interval)


def http_get(port: int, path: str) -> tuple[int, str]:
    """The status and body of ``GET http://127.0.0.1:<port><path>``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def metric(port: int, name: str) -> float:
    """The sum of the samples on ``port``'s ``/metrics`` whose line starts with ``name``."""
    _, text = http_get(port, "/metrics")
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    return sum(values)


def wait_ready(port: int, process: subprocess.Popen[str], *, timeout: float = 30) -> None:
    """Return once ``process`` answers 200 on ``/readyz`` at ``port``; fail with its stderr
    when it exits first, or after ``timeout``."""

    def ready() -> bool:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            return http_get(port, "/readyz")[0] == 200
        except OSError:
            return False

    wait_until(ready, timeout=timeout)
