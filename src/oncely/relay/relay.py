"""The relay loop: claim → produce → confirm → settle.

Rules the loop keeps (each is tested against real PostgreSQL and Kafka):

- A row becomes ``published`` only after the broker's delivery report says so; the settle is
  fenced by this relay's id and the row's attempt, so a relay that lost its lease (paused,
  partitioned) cannot overwrite the row another relay now owns (counted as ``lease_lost``).
- Per-key order: a claim only returns the oldest unsettled row of each key, so there is at most
  one row per key in flight in the whole system, and a batch never holds two rows of one key.
  A failing row therefore holds back its own key (and no other), and a later row of that key
  can never be settled as published ahead of it.
- Pipelining: the next batch is claimed while the previous one still awaits its reports
  (bounded by ``max_in_flight``); settles are batched, one statement per kind.
- Failures back off exponentially with jitter; transient broker trouble retries forever,
  permanent errors go ``dead`` after ``max_attempts`` (see :mod:`oncely.relay.policy`).
- Database or broker outages never crash the loop: it waits and tries again. Refused
  credentials are not an outage: the loop stops, gives back its leases and raises
  :class:`~oncely.security.KafkaAuthenticationError`.
- Graceful stop: stop claiming, wait (bounded) for outstanding reports, settle them, and give
  back the leases of rows still without a result.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import KafkaError, Message

from oncely.ops.failpoints import failpoint
from oncely.ops.metrics import RelayMetrics
from oncely.relay import policy
from oncely.relay.publisher import Publisher
from oncely.relay.records import ClaimedRow
from oncely.relay.store import Failed, OutboxStore, Published, TopicBacklog
from oncely.relay.wakeup import Wakeup
from oncely.security import KafkaAuthenticationError
from oncely.settings import RelaySettings

log = logging.getLogger(__name__)

_GAUGE_INTERVAL = 5.0
_Result = tuple[ClaimedRow, KafkaError | None, Message | None]


class Relay:
    """One relay process's loop; ``run(stop)`` returns after a graceful drain."""

    def __init__(
        self,
        *,
        store: OutboxStore,
        publisher_factory: Callable[[Callable[..., None]], Publisher],
        settings: RelaySettings,
        metrics: RelayMetrics,
        wakeup: Wakeup | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._wakeup = wakeup
        self._results: list[_Result] = []
        self._in_flight: dict[UUID, ClaimedRow] = {}
        self._gauged_topics: set[str] = set()
        self._more_due = True
        self._publisher = publisher_factory(self._record_result)
        self.heartbeat = time.monotonic()
        self.database_ok = True

    def healthy(self) -> bool:
        """The loop turned recently (it is not stuck)."""
        return time.monotonic() - self.heartbeat < max(30.0, self.settings.lease_seconds)

    def ready(self) -> bool:
        """The last database call worked and the broker is reachable."""
        return self.healthy() and self.database_ok and not self._publisher.brokers_down

    def _record_result(
        self, row: ClaimedRow, error: KafkaError | None, message: Message | None
    ) -> None:
        self._results.append((row, error, message))

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set, then drain; never raises for broker or database faults.

        Raises :class:`KafkaAuthenticationError` (after giving back its leases) when the
        broker refuses the credentials.
        """
        next_gauges = next_purge = time.monotonic()
        while not stop.is_set():
            self.heartbeat = now = time.monotonic()
            if self._publisher.auth_failed is not None:
                break
            if self._publisher.fatal is not None:
                self._publisher.recreate()
            claimed = self._claim()
            self._publisher.poll(0)
            self._settle()
            if now >= next_gauges:
                self._update_gauges()
                next_gauges = now + _GAUGE_INTERVAL
            if now >= next_purge:
                self._purge()
                next_purge = now + self.settings.purge_interval_seconds
            if claimed:
                continue
            if self._in_flight:
                self._publisher.poll(0.05)
            elif self._wakeup is not None:
                self._wakeup.wait(self.settings.poll_interval_seconds)
            else:
                stop.wait(self.settings.poll_interval_seconds)
        self._drain()
        if self._publisher.auth_failed is not None:
            raise KafkaAuthenticationError.of(self._publisher.auth_failed)

    def _claim(self) -> list[ClaimedRow]:
        room = self.settings.max_in_flight - len(self._in_flight)
        # While rows are in flight, claim again only if the last claim was full or a settle has
        # since freed keys: a claim that finds nothing still scans the backlog.
        if room <= 0 or (self._in_flight and not self._more_due):
            return []
        try:
            claimed = self.store.claim(
                batch_size=min(room, self.settings.batch_size),
                lease_seconds=self.settings.lease_seconds,
            )
        except sa.exc.DBAPIError as exc:
            self._database_failed("claim", exc)
            return []
        self.database_ok = True
        self._more_due = len(claimed) == min(room, self.settings.batch_size)
        if claimed:
            failpoint("relay.after_claim")
        for row in claimed:
            self._in_flight[row.id] = row
            self.metrics.claimed.labels(row.topic).inc()
            self._publisher.produce(row)
        if claimed:
            failpoint("relay.after_produce_before_ack")
        return claimed

    def _settle(self) -> None:
        if not self._results:
            return
        results, self._results = self._results, []
        failpoint("relay.after_ack_before_mark")
        published: list[Published] = []
        failed: list[Failed] = []
        now = datetime.now(UTC)
        for row, error, message in results:
            if error is None and message is not None:
                published.append(Published(row, message.partition() or 0, message.offset() or 0))
                self.metrics.publish_latency.observe((now - row.created_at).total_seconds())
            else:
                assert error is not None
                failed.append(
                    Failed(
                        row,
                        policy.backoff_seconds(
                            row.attempts,
                            base=self.settings.backoff_base_seconds,
                            maximum=self.settings.backoff_max_seconds,
                        ),
                        policy.error_text(error),
                        policy.goes_dead(
                            error, row.attempts, max_attempts=self.settings.max_attempts
                        ),
                    )
                )
        try:
            done = self.store.mark_published(published, delete=self.settings.retention_seconds == 0)
            undone = self.store.mark_failed(failed)
        except sa.exc.DBAPIError as exc:
            self._results = results + self._results  # settle them on the next turn
            self._database_failed("settle", exc)
            return
        self.database_ok = True
        refused = {*done.lease_lost, *undone.lease_lost}
        for item in published:
            if item.row.id not in refused:
                self.metrics.published.labels(item.row.topic).inc()
        dead = set(undone.dead)
        for failure in failed:
            if failure.row.id in refused:
                continue
            if failure.row.id in dead:
                self.metrics.dead.labels(failure.row.topic).inc()
                log.error(
                    "row went dead: %s",
                    failure.error,
                    extra={"id": str(failure.row.id), "topic": failure.row.topic},
                )
            else:
                self.metrics.retries.labels(failure.row.topic).inc()
        if refused:
            self.metrics.lease_lost.inc(len(refused))
            log.warning(
                "%d settle(s) refused: another relay re-claimed the rows",
                len(refused),
                extra={"ids": [str(i) for i in refused]},
            )
        for row, _, _ in results:
            self._in_flight.pop(row.id, None)
        self._more_due = True

    def _update_gauges(self) -> None:
        try:
            backlog = self.store.backlog()
        except sa.exc.DBAPIError as exc:
            self._database_failed("backlog", exc)
            return
        drained = self._gauged_topics - {topic.topic for topic in backlog}
        for topic in [*backlog, *(TopicBacklog(name, 0, 0, 0.0) for name in drained)]:
            self.metrics.backlog.labels(topic.topic).set(topic.pending)
            self.metrics.dead_rows.labels(topic.topic).set(topic.dead)
            self.metrics.oldest_pending.labels(topic.topic).set(topic.oldest_pending_seconds)
            self._gauged_topics.add(topic.topic)

    def _purge(self) -> None:
        if self.settings.retention_seconds == 0:
            return
        try:
            purged = self.store.purge(older_than_seconds=self.settings.retention_seconds)
        except sa.exc.DBAPIError as exc:
            self._database_failed("purge", exc)
            return
        if purged:
            log.info("purged %d published rows", purged)

    def _database_failed(self, what: str, exc: sa.exc.DBAPIError) -> None:
        self.database_ok = False
        log.warning("database %s failed, retrying: %s", what, exc.orig)
        time.sleep(min(1.0, self.settings.poll_interval_seconds))

    def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.shutdown_timeout_seconds
        while (
            self._in_flight and self._publisher.auth_failed is None and time.monotonic() < deadline
        ):
            self._publisher.flush(min(1.0, max(0.0, deadline - time.monotonic())))
            self._settle()
        unanswered = list(self._in_flight.values())
        try:
            released = self.store.release(unanswered)
        except sa.exc.DBAPIError as exc:
            log.warning("could not release %d leases: %s", len(unanswered), exc.orig)
            released = 0
        if self._wakeup is not None:
            self._wakeup.close()
        log.info("relay stopped", extra={"released": released, "unanswered": len(unanswered)})
