"""The process shell of the relay, the consumers and the task worker.

Each ``oncely ... run`` process is the same shell around its own loop: an id naming it in
leases and listings (:func:`process_id`), SIGTERM and SIGINT setting a stop event
(:func:`stop_on_signals`), one engine disposed at exit (:func:`database`), the
``/metrics``, ``/healthz`` and ``/readyz`` port when one is configured (:func:`serving`), and
duties done every so often inside the loop (:class:`Every`).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from oncely.errors import ConfigurationError
from oncely.runtime.http import HealthServer

log = logging.getLogger(__name__)


class MetricsPortError(ConfigurationError):
    """The port of ``/metrics``, ``/healthz`` and ``/readyz`` cannot be bound."""


def process_id() -> str:
    """``<hostname>-<pid>-<6 random hex digits>``: unique per process, readable as an owner."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@contextmanager
def stop_on_signals(stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """An event that SIGTERM and SIGINT set (``stop``, or a new one); the previous handlers are
    restored on exit. Off the main thread no handler can be installed: the event is only set by
    whoever else holds it."""
    event = stop or threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return

    def request_stop(signum: int, frame: FrameType | None) -> None:
        log.info("stopping on signal %s", signal.Signals(signum).name)
        event.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def database(url: str, **options: Any) -> Iterator[sa.Engine]:
    """The process's engine (``sa.create_engine(url, **options)``), disposed on exit."""
    engine = sa.create_engine(url, **options)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def serving(
    port: int | None,
    *,
    registry: CollectorRegistry,
    healthy: Callable[[], bool],
    ready: Callable[[], bool],
) -> Iterator[HealthServer | None]:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``port`` until exit (nothing when
    ``port`` is ``None``); yields the server, whose ``port`` is the bound one (``0`` picks).
    Raises :class:`MetricsPortError` when the port cannot be bound (taken, for one)."""
    if port is None:
        yield None
        return
    try:
        server = HealthServer(registry=registry, healthy=healthy, ready=ready, port=port)
    except (OSError, OverflowError) as exc:  # taken, not allowed, or not a port
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MetricsPortError(
            f"cannot serve /metrics, /healthz and /readyz on port {port} ({reason}); choose "
            "a free port with --metrics-port, or stop the process that listens on it"
        ) from exc
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Every:
    """A duty due every ``seconds`` on the monotonic clock (or ``clock``), the first time at
    once (or after ``seconds`` with ``now=False``)."""

    def __init__(
        self, seconds: float, *, now: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self._clock = clock
        self._next = clock() + (0.0 if now else seconds)

    def due(self) -> bool:
        """Whether the duty is due; if so, the next time is ``seconds`` from now."""
        current = self._clock()
        if current < self._next:
            return False
        self._next = current + self.seconds
        return True

    def remaining(self) -> float:
        """Seconds until the duty is due (0 when it is)."""
        return max(0.0, self._next - self._clock())
