"""The container health check: ask the oncely process of this container its ``/healthz``.

A relay, a consumer and a task worker serve ``/healthz`` on whatever ``--metrics-port`` (or
``ONCELY_*_METRICS_PORT``) they were given, so the check does not take a port: it finds the
TCP ports the container's main process (PID 1, or a child of it when an init runs first)
listens on and asks each. One image health check then fits every process, on any port and
in any network mode, including a host network shared with other containers.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

import psutil

from oncely.errors import OncelyError


class HealthCheckError(OncelyError):
    """The process is not healthy, or serves no health endpoint."""


def listening_ports(pid: int) -> list[int]:
    """The TCP ports ``pid`` and its descendants listen on, sorted."""
    root = psutil.Process(pid)
    ports: set[int] = set()
    for process in [root, *root.children(recursive=True)]:
        for conn in process.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                ports.add(conn.laddr.port)
    return sorted(ports)


def check(*, pid: int = 1, path: str = "/healthz", timeout: float = 5.0) -> int:
    """Return the port on which ``pid``'s process answers 200 on ``path``.

    Raises:
        HealthCheckError: the process does not exist or serves no port, or no port answers 200.
    """
    try:
        ports = listening_ports(pid)
    except psutil.Error as exc:
        raise HealthCheckError(f"cannot inspect process {pid}: {exc}") from exc
    if not ports:
        raise HealthCheckError(
            f"process {pid} listens on no TCP port: start it with --metrics-port (or "
            "ONCELY_RELAY_METRICS_PORT, ONCELY_CONSUMER_METRICS_PORT, ONCELY_TASKS_METRICS_PORT)"
        )
    answers: list[str] = []
    for port in ports:
        url = f"http://127.0.0.1:{port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout):
                return port
        except urllib.error.HTTPError as exc:
            answers.append(f"{url} answered {exc.code}")
        except OSError as exc:
            answers.append(f"{url} failed: {exc}")
        except http.client.HTTPException as exc:  # a port of another protocol (TLS, Kafka...)
            answers.append(f"{url} does not answer HTTP ({type(exc).__name__})")
    raise HealthCheckError("; ".join(answers))
