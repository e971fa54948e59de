"""One small HTTP port per process: Prometheus ``/metrics``, ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 while the process's loop is alive (not stuck); ``/readyz`` answers 200
while it can do its work (database and broker reachable). Both answer 503 otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class HealthServer:
    """Serves metrics and health checks on ``host:port`` from a daemon thread."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        healthy: Callable[[], bool],
        ready: Callable[[], bool],
        port: int,
        host: str = "0.0.0.0",  # noqa: S104 (a container's health port)
    ) -> None:
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path in ("/healthz", "/readyz"):
                ok = healthy() if path == "/healthz" else ready()
                start_response(
                    "200 OK" if ok else "503 Service Unavailable",
                    [("Content-Type", "text/plain")],
                )
                return [b"ok\n" if ok else b"not ok\n"]
            return metrics(environ, start_response)  # type: ignore[no-any-return]

        self._server = make_server(
            host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="oncely-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
