"""The task worker: ``oncely tasks run myapp.tasks:tasks``.

A sync process that loops, as its :class:`~oncely.settings.TaskSettings` say: purge terminal
tasks past the retention period (every ``purge_interval_seconds``), sweep (TTLs and expired
leases, see :mod:`.rules`), lease the oldest due task it has a handler for (``FOR UPDATE SKIP
LOCKED``, so workers run side by side), run its handler outside any transaction, and settle
the result fenced by attempt and owner. When nothing is due it waits for ``NOTIFY
oncely_tasks`` (sent at the commit of every enqueue) for at most ``poll_interval_seconds``.
:func:`run_worker` runs it as a process, with ``/metrics``, ``/healthz`` and ``/readyz``.

Guarantees: it refuses to start while a queued or leased task's name (or a required name) has
no handler (:class:`MissingHandlerError`); a result whose lease was lost is refused and
reported as ``lease_lost``, never as a success; SIGTERM or SIGINT lets the current task finish
and settle, then :meth:`TaskWorker.run` returns (nothing stays leased). A database error stops
the worker (the supervisor restarts it): the lease it held expires and the sweep settles it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import sqlalchemy as sa

from oncely.runtime.metrics import TaskMetrics
from oncely.runtime.process import Every, database, process_id, serving, stop_on_signals
from oncely.runtime.retry import Backoff
from oncely.runtime.tracing import Tracing
from oncely.runtime.wakeup import Wakeup
from oncely.settings import TaskSettings
from oncely.storage.tables import TASKS_NOTIFY_CHANNEL
from oncely.tasks.app import Tasks
from oncely.tasks.errors import MissingHandlerError
from oncely.tasks.model import Attempt, Observer, TaskFailure
from oncely.tasks.store import TaskStore, lease_sql

logger = logging.getLogger(__name__)


class TaskWorker:
    """Runs the handlers of a :class:`Tasks` app over ``oncely_tasks``, one task at a time, as
    ``settings`` say (lease, poll, retries' backoff, retention and purge interval, owner id).

    Run several processes to run tasks in parallel. ``observer`` is told of every failure and
    dead letter (:class:`TaskFailure`); its own errors are logged and ignored. Each attempt
    runs inside a span recorded by ``tracing`` (default: the global tracer provider).
    """

    def __init__(
        self,
        *,
        engine: sa.Engine,
        tasks: Tasks,
        settings: TaskSettings,
        observer: Observer | None = None,
        metrics: TaskMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine = engine
        self.tasks = tasks
        self.settings = settings
        self.store = TaskStore(
            engine=engine,
            lease_seconds=settings.lease_seconds,
            backoff=Backoff(
                first=settings.initial_backoff_seconds, maximum=settings.max_backoff_seconds
            ),
            tracing=tracing or Tracing(),
        )
        self.observer = observer
        self.owner_id = settings.owner_id or process_id()
        self.metrics = metrics or TaskMetrics()
        #: When the loop last turned (``time.monotonic()``).
        self.heartbeat = time.monotonic()
        self._running = False
        self._stop = threading.Event()

    def healthy(self) -> bool:
        """The loop turned recently: within a lease and a poll (a task runs at most its lease)."""
        limit = self.store.lease_seconds + max(30.0, self.settings.poll_interval_seconds)
        return time.monotonic() - self.heartbeat < limit

    def ready(self) -> bool:
        """The worker is serving (a database error stops it) and its loop is not stuck."""
        return self._running and self.healthy()

    def check(self) -> None:
        """Refuse to start without a handler for every waiting (or required) task name.

        Raises :class:`MissingHandlerError` naming them.
        """
        missing = self.tasks.missing(self.store.waiting_names())
        if missing:
            raise MissingHandlerError(missing)

    def run_once(self) -> Attempt | None:
        """Lease one due task, run it and settle it; ``None`` if nothing was due."""
        lease = lease_sql(self.owner_id, self.tasks.names, self.store.lease_seconds)
        attempt = self.store.run(lease, self.tasks.dispatch)
        if attempt is not None:
            self.metrics.attempts.labels(attempt.task.name, attempt.outcome).inc()
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
            self.metrics.swept.labels(change.outcome).inc()
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
        """Delete terminal tasks finished longer than ``settings.retention_seconds`` ago."""
        purged = self.store.purge(self.settings.retention_seconds)
        self.metrics.purged.inc(purged)
        if purged:
            logger.info("purged %d finished tasks", purged, extra={"purged": purged})
        return purged

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current task (what SIGTERM does); final."""
        self._stop.set()

    def run(self) -> None:
        """Serve tasks until :meth:`stop`, SIGTERM or SIGINT; check handlers first.

        Raises :class:`MissingHandlerError` before leasing anything if a handler is missing;
        database errors propagate.
        """
        self.check()
        wakeup = Wakeup.of(self.engine, channel=TASKS_NOTIFY_CHANNEL, stop=self._stop)
        with stop_on_signals(self._stop) as stop, contextlib.closing(wakeup):
            wakeup.listen()
            logger.info(
                "task worker %s serving %s",
                self.owner_id,
                ", ".join(sorted(self.tasks.names)),
                extra={"worker_id": self.owner_id},
            )
            purge = Every(self.settings.purge_interval_seconds)
            sweep = Every(self.settings.poll_interval_seconds)
            self._running = True
            try:
                while not stop.is_set():
                    self.heartbeat = time.monotonic()
                    if purge.due():
                        self.purge()
                    if sweep.due():
                        self.sweep()
                    if self.run_once() is None and not stop.is_set():
                        wakeup.wait(sweep.remaining())
            finally:
                self._running = False
        logger.info("task worker %s stopped", self.owner_id, extra={"worker_id": self.owner_id})

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


def run_worker(tasks: Tasks, *, database_url: str, settings: TaskSettings) -> None:
    """Run a :class:`TaskWorker` over ``database_url`` until SIGTERM or SIGINT, serving
    ``/metrics``, ``/healthz`` and ``/readyz`` on ``settings.metrics_port`` when set.

    Raises :class:`MissingHandlerError` before leasing anything if a handler is missing;
    database errors propagate (the lease held expires and the sweep settles it).
    """
    with database(database_url) as engine:
        worker = TaskWorker(engine=engine, tasks=tasks, settings=settings)
        with serving(
            settings.metrics_port,
            registry=worker.metrics.registry,
            healthy=worker.healthy,
            ready=worker.ready,
        ):
            worker.run()
