"""The relay's purge timer, off its loop: one run at a time on a thread of its own, so a long
purge, a lock wait or a slow Kafka never delays reading, publishing or renewing leases.

Which purge runs is decided at each run until the tables are found partitioned: on
unpartitioned tables the batched DELETE of published rows older than ``retention_seconds``; on
partitioned tables (``oncely db upgrade --partition-every``) :func:`oncely.retention.run`, or only
:func:`oncely.retention.plan` when ``ONCELY_RETENTION_IN_RELAY=false`` (a Job drops the
partitions; the relay still exports the ``oncely_retention_*`` gauges). A relay running while
``db upgrade --partition-every`` converts the tables turns to retention at its next run (one
catalog query a run while unpartitioned; a conversion is never undone). No failure of a purge
stops the relay: it is logged, counted in ``oncely_retention_errors_total`` on partitioned
tables, and tried again at the next interval. A run that finds another in progress (every relay
runs retention on its timer) leaves the gauges as they were; after a run whose drop did not get
its lock, the later runs drop nothing for a while (the project's
:class:`~oncely.runtime.retry.Backoff`, with jitter, so that relays do not retry together and
stall staging again and again) but still create the partitions ahead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta

import sqlalchemy as sa

from oncely import retention
from oncely.retention.guard import Watermarks
from oncely.runtime.metrics import RetentionMetrics
from oncely.runtime.retry import Backoff
from oncely.settings import ClientConfig, RelaySettings, RetentionSettings
from oncely.storage import partitions
from oncely.storage.errors import missing_tables
from oncely.storage.stores.outbox.relay import RelayStore

log = logging.getLogger(__name__)


class Housekeeping:
    """Starts the relay's purge on a daemon thread when :meth:`due` is called and none runs."""

    def __init__(
        self,
        *,
        store: RelayStore,
        settings: RelaySettings,
        retention_settings: RetentionSettings,
        kafka: ClientConfig,
        metrics: RetentionMetrics,
    ) -> None:
        self.store = store
        self.settings = settings
        self.retention_settings = retention_settings
        # A relay that creates partitions (retention in the relay) runs every purge interval:
        # its partitions ahead must outlast that (a run refuses otherwise, counted as an error).
        every = timedelta(seconds=settings.purge_interval_seconds)
        self.policy = retention.policy_of(
            retention_settings, settings, interval=every if retention_settings.in_relay else None
        )
        self.metrics = metrics
        self._kafka = kafka
        self._thread: threading.Thread | None = None
        #: The tables' partition step once a run has found them partitioned (``None``: not
        #: yet, asked again at every run).
        self._step: timedelta | None = None
        #: Runs finished (failed or not): tests wait on it.
        self.runs = 0
        #: After a drop's lock not granted, the runs until ``_resume_at`` (monotonic) drop
        #: nothing (they still create the partitions ahead, which take no lock staging waits on).
        interval = settings.purge_interval_seconds
        self._backoff = Backoff(
            first=2 * interval, maximum=16 * interval, multiplier=2.0, jitter=0.5
        )
        self._lock_failures = 0
        self._resume_at = 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def due(self) -> None:
        """Start a run unless one is still running (it then goes on; no run is queued)."""
        if self.running:
            return
        self._thread = threading.Thread(target=self._run, name="oncely-relay-purge", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the run in progress (at the relay's stop)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            if self._step is None:
                with self.store.engine.connect() as conn:
                    self._step = partitions.step_of(conn)
            if self._step is None:
                self._purge()
            else:
                self._retention()
        except Exception as exc:  # a purge never stops the relay
            if self._step is not None:
                self.metrics.errors.inc()
            cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
            if not missing_tables(exc):  # the loop says that once
                log.warning("purge failed, retried at the next interval: %s", cause)
        finally:
            self.runs += 1

    def _purge(self) -> None:
        purged = self.store.purge(older_than_seconds=self.settings.retention_seconds)
        if purged:
            log.info("purged %d published rows", purged)

    def _retention(self) -> None:
        engine = self.store.engine
        policy = self.policy
        if not self.retention_settings.in_relay:
            plan = retention.plan(engine, policy, self._watermarks)
            retention.record(self.metrics, plan, policy)
            return
        drop = time.monotonic() >= self._resume_at
        outcome = retention.run(engine, policy, self._watermarks, drop=drop)
        if outcome.plan is None:
            return  # another run is in progress: the gauges stay as its last plan left them
        if outcome.lock_refused:
            self._lock_failures += 1
            self._resume_at = time.monotonic() + self._backoff.delay(self._lock_failures)
        elif drop:
            self._lock_failures = 0
        tables = retention.states(engine, policy) if outcome.dropped else None
        retention.record(self.metrics, outcome.plan, policy, outcome, tables=tables)
        if outcome.created or outcome.dropped or outcome.purged:
            log.info(
                "retention: created %d and dropped %d partitions, deleted %d default rows",
                len(outcome.created),
                len(outcome.dropped),
                outcome.purged,
                # "created" is a LogRecord attribute: extra may not set it.
                extra={
                    "partitions_created": outcome.created,
                    "partitions_dropped": outcome.dropped,
                    "default_rows_deleted": outcome.purged,
                },
            )
        for error in outcome.errors:
            log.warning("retention: %s", error)

    def _watermarks(self, topics: Iterable[str]) -> dict[str, Mapping[int, Watermarks] | None]:
        return retention.watermarks(
            self._kafka, topics, timeout=self.retention_settings.kafka_timeout_seconds
        )
