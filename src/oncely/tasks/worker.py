"""The task worker: ``oncely tasks run myapp.tasks:tasks``.

A sync process that loops: purge terminal tasks past the retention period (every minute),
sweep (TTLs and expired leases, see :mod:`.rules`), lease the oldest due task it has a handler
for (``FOR UPDATE SKIP LOCKED``, so workers run side by side), run its handler outside any
transaction, and settle the result fenced by attempt and owner. When nothing is due it waits
for ``NOTIFY oncely_tasks`` (sent at the commit of every enqueue) for at most ``poll_seconds``.

Guarantees: it refuses to start while a queued or leased task's name (or a required name) has
no handler (:class:`MissingHandlerError`); a result whose lease was lost is refused and
reported as ``lease_lost``, never as a success; SIGTERM or SIGINT lets the current task finish
and settle, then :meth:`TaskWorker.run` returns (nothing stays leased). A database error stops
the worker (the supervisor restarts it): the lease it held expires and the sweep settles it.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, cast

import psycopg
import sqlalchemy as sa

from oncely.storage.tables import TASKS_NOTIFY_CHANNEL
from oncely.tasks.app import Tasks
from oncely.tasks.errors import MissingHandlerError
from oncely.tasks.model import Attempt, Observer, TaskFailure
from oncely.tasks.rules import Backoff
from oncely.tasks.store import DEFAULT_LEASE_SECONDS, TaskStore, lease_sql

logger = logging.getLogger(__name__)

DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0
PURGE_EVERY_SECONDS = 60.0


def new_worker_id() -> str:
    """``<hostname>-<pid>-<6 random hex digits>``: unique per process, readable in listings."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class TaskWorker:
    """Runs the handlers of a :class:`Tasks` app over ``oncely_tasks``, one task at a time.

    Run several processes to run tasks in parallel. ``observer`` is told of every failure and
    dead letter (:class:`TaskFailure`); its own errors are logged and ignored.
    """

    def __init__(
        self,
        *,
        engine: sa.Engine,
        tasks: Tasks,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = 2.0,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        backoff: Backoff | None = None,
        observer: Observer | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.tasks = tasks
        self.store = TaskStore(engine=engine, lease_seconds=lease_seconds, backoff=backoff)
        self.poll_seconds = poll_seconds
        self.retention_seconds = retention_seconds
        self.observer = observer
        self.worker_id = worker_id or new_worker_id()
        self._stopping = False

    def check(self) -> None:
        """Refuse to start without a handler for every waiting (or required) task name.

        Raises :class:`MissingHandlerError` naming them.
        """
        missing = self.tasks.missing(self.store.waiting_names())
        if missing:
            raise MissingHandlerError(missing)

    def run_once(self) -> Attempt | None:
        """Lease one due task, run it and settle it; ``None`` if nothing was due."""
        claim = lease_sql(self.worker_id, self.tasks.names, self.store.lease_seconds)
        attempt = self.store.run(claim, self.tasks.dispatch)
        if attempt is not None:
            self._report(attempt)
        return attempt

    def dispatch_pending(self, limit: int = 20) -> int:
        """Sweep, then run up to ``limit`` due tasks now; return how many ran.

        For schedulers and start-up compensation (tasks a crashed process left behind).
        """
        self.sweep()
        ran = 0
        while ran < limit and self.run_once() is not None:
            ran += 1
        return ran

    def sweep(self) -> list[TaskFailure]:
        """Expire tasks past their TTL and settle expired leases; report each change."""
        changes = self.store.sweep()
        for change in changes:
            logger.warning(
                "task %s %s (%s) %s after attempt %d: %s",
                change.name,
                change.task_key,
                change.task_id,
                change.outcome,
                change.attempt,
                change.error,
                extra={"task_id": str(change.task_id), "outcome": change.outcome},
            )
            self._observe(change)
        return changes

    def purge(self) -> int:
        """Delete terminal tasks finished longer than ``retention_seconds`` ago."""
        purged = self.store.purge(self.retention_seconds)
        if purged:
            logger.info("purged %d finished tasks", purged, extra={"purged": purged})
        return purged

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current task (what SIGTERM does); final."""
        self._stopping = True

    def run(self) -> None:
        """Serve tasks until :meth:`stop`, SIGTERM or SIGINT; check handlers first.

        Raises :class:`MissingHandlerError` before leasing anything if a handler is missing;
        database errors propagate.
        """
        self.check()
        with self._listening() as listener, self._stop_on_signals():
            logger.info(
                "task worker %s serving %s",
                self.worker_id,
                ", ".join(sorted(self.tasks.names)),
                extra={"worker_id": self.worker_id},
            )
            next_sweep = next_purge = time.monotonic()
            while not self._stopping:
                if time.monotonic() >= next_purge:
                    self.purge()
                    next_purge = time.monotonic() + PURGE_EVERY_SECONDS
                if time.monotonic() >= next_sweep:
                    self.sweep()
                    next_sweep = time.monotonic() + self.poll_seconds
                if self.run_once() is None and not self._stopping:
                    timeout = max(0.0, next_sweep - time.monotonic())
                    for _ in listener.notifies(timeout=timeout, stop_after=1):
                        pass
        logger.info("task worker %s stopped", self.worker_id, extra={"worker_id": self.worker_id})

    @contextmanager
    def _listening(self) -> Iterator[psycopg.Connection[Any]]:
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql(f"LISTEN {TASKS_NOTIFY_CHANNEL}")
            try:
                yield cast("psycopg.Connection[Any]", conn.connection.driver_connection)
            finally:
                conn.exec_driver_sql("UNLISTEN *")

    @contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum: int, frame: FrameType | None) -> None:
            self._stopping = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _report(self, attempt: Attempt) -> None:
        task = attempt.task
        context = {"task_id": str(task.id), "attempt": task.attempt, "outcome": attempt.outcome}
        if attempt.outcome == "completed":
            logger.info(
                "task %s %s completed on attempt %d",
                task.name,
                task.task_key,
                task.attempt,
                extra=context,
            )
            return
        message = attempt.message if attempt.message is not None else str(attempt.error)
        logger.warning(
            "task %s %s attempt %d: %s (%s)",
            task.name,
            task.task_key,
            task.attempt,
            attempt.outcome,
            message,
            extra=context,
        )
        self._observe(
            TaskFailure(
                task_id=task.id,
                task_key=task.task_key,
                name=task.name,
                attempt=task.attempt,
                outcome=attempt.outcome,
                error=message,
                retry_in=attempt.retry_in,
            )
        )

    def _observe(self, failure: TaskFailure) -> None:
        if self.observer is None:
            return
        try:
            self.observer(failure)
        except Exception:
            logger.exception("the task observer failed on %s", failure)
