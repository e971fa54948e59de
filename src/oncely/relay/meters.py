"""What the relay tells the outside about itself: its counters and gauges (one place for each)
and, when a test listens, its :mod:`~oncely.relay.signals`.

Confirmations are counted in the delivery reports' pages and moved into the counters once per
settle (:meth:`Meters.flush`); the backlog and blocked-rows gauges are read from the database
every few seconds, and not at all while nothing changes. In exactly-once mode the transactions
that ended are counted as the publisher reports them (:meth:`Meters.transactions`), and the
progress-lag gauge says how long PostgreSQL's recorded progress has trailed Kafka's.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable

from oncely.relay.ports import FAILED, Guard, RelayStore
from oncely.relay.publisher import position
from oncely.relay.shards import Page
from oncely.relay.signals import Signal, Signals
from oncely.relay.transactions import Ended, Outcome
from oncely.runtime.metrics import RelayMetrics
from oncely.storage.stores.outbox.relay import Progress, ShardBacklog, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow

#: The backlog and blocked-rows gauges are read this often (seconds).
GAUGE_INTERVAL = 5.0


class Meters:
    """The relay's metrics, the confirmations not yet counted, and the gauges' cadence."""

    def __init__(
        self,
        metrics: RelayMetrics,
        signals: Signals | None,
        *,
        exactly_once: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``exactly_once``: the relay's mode (the transactions' series exist only then);
        ``clock``: the monotonic clock the progress lag is measured with."""
        self.metrics = metrics
        self.signals = signals
        self._exactly_once = exactly_once
        self._clock = clock
        #: Per shard, the positions committed to Kafka that PostgreSQL has not recorded yet,
        #: oldest first, each with when its commit was reported.
        self._unrecorded: dict[int, deque[tuple[Progress, float]]] = {}
        if exactly_once:
            for outcome in Outcome:  # every outcome's series from 0, so increase() sees the first
                metrics.transactions.labels(outcome.value)
        self._confirmed: dict[tuple[str, int], int] = {}
        self._latencies: list[float] = []
        self._blocked_gauged: set[str] = set()
        #: Rows read since the backlog gauges were last read, and whether they showed any.
        self._rows_read = 0
        self._backlog_seen = True

    def _signal(self, signal: Signal, shards: Collection[int]) -> None:
        if self.signals is not None:
            self.signals.emit(signal, shards)

    # -- counters ------------------------------------------------------------------------------

    def acknowledged(self, page: Page) -> None:
        """An acknowledged page's rows are published (counted at the next :meth:`flush`), and
        its latency, from its oldest row's commit, observed once."""
        produced = page.produced
        if not produced:
            return
        confirmed = self._confirmed
        for topic, count in Counter(row.topic for row in produced).items():
            key = (topic, page.shard)
            confirmed[key] = confirmed.get(key, 0) + count
        self._latencies.append(time.time() - min(row.timestamp_ms for row in produced) / 1000)

    def flush(self) -> None:
        """Move the confirmations counted since the last flush into the metrics."""
        if self._confirmed:
            for (topic, shard), count in self._confirmed.items():
                self.metrics.published.labels(topic).inc(count)
                self.metrics.shard_published.labels(str(shard)).inc(count)
            self._confirmed.clear()
        if self._latencies:
            observe = self.metrics.publish_latency.observe
            for latency in self._latencies:
                observe(max(0.0, latency))
            self._latencies.clear()

    def produce_error(self, topic: str, shard: int, code: str) -> None:
        self.metrics.produce_errors.labels(topic, code).inc()
        self.metrics.shard_produce_errors.labels(str(shard)).inc()

    def dead(self, topic: str) -> None:
        self.metrics.dead.labels(topic).inc()

    def replayed(self, shard: int) -> None:
        self.metrics.shard_replays.labels(str(shard)).inc()
        self._signal(Signal.REPLAYED, (shard,))

    def recreated(self, reason: str) -> None:
        self.metrics.producer_recreations.labels(reason).inc()

    def refused(self, shards: Collection[int]) -> None:
        """Progress writes refused: the shards were taken over."""
        self.metrics.progress_refused.inc(len(shards))

    def transactions(self, ended: Iterable[Ended]) -> None:
        """Transactions that ended (exactly-once mode): counted by outcome and their time
        observed; a commit's position waits for PostgreSQL's record (:meth:`recorded`)."""
        for end in ended:
            self.metrics.transactions.labels(end.outcome.value).inc()
            self.metrics.transaction_seconds.observe(end.seconds)
            if end.progress is not None:
                waiting = self._unrecorded.setdefault(end.shard, deque())
                waiting.append((position(end.progress), self._clock()))

    def recorded(self, progress: Collection[ShardProgress]) -> None:
        """PostgreSQL recorded ``progress``: the commits it reaches are recorded."""
        if progress:
            self._signal(Signal.RECORDED, [p.shard for p in progress])
        if self._unrecorded:
            for item in progress:
                waiting = self._unrecorded.get(item.shard)
                while waiting and not waiting[0][0].beyond(item.progress):
                    waiting.popleft()

    def published_alone(self, rows: Iterable[OutboxRow]) -> None:
        """Rows of a released key were published (each confirmed on its own)."""
        for row in rows:
            self.metrics.published.labels(row.topic).inc()
            self.metrics.shard_published.labels(str(row.shard)).inc()

    def released(self, shard: int) -> None:
        self._signal(Signal.RELEASED, (shard,))

    # -- shards held -----------------------------------------------------------------------------

    def took(self, leases: Iterable[ShardProgress]) -> None:
        numbers = []
        for lease in leases:
            self.metrics.lease_epoch.labels(str(lease.shard)).set(lease.epoch)
            numbers.append(lease.shard)
        self._backlog_seen = True
        self._signal(Signal.TOOK, numbers)

    def lost(self, shard: int) -> None:
        """The shard was taken over before this relay gave it back."""
        self.metrics.lease_lost.inc()
        self._signal(Signal.LOST, (shard,))

    def handed_off(self, shards: Collection[int]) -> None:
        self._signal(Signal.HANDED_OFF, shards)

    def forget(self, shard: int) -> None:
        """The shard is no longer held: its gauges go."""
        self._unrecorded.pop(shard, None)
        for gauge in (self.metrics.lease_epoch, self.metrics.held_keys, self.metrics.progress_lag):
            with contextlib.suppress(KeyError):
                gauge.remove(str(shard))

    def shards(self, held: int, held_keys: dict[int, int]) -> None:
        """At each heartbeat: the shards held and the parked keys of each."""
        self.metrics.shards.set(held)
        for shard, count in held_keys.items():
            self.metrics.held_keys.labels(str(shard)).set(count)

    # -- gauges read from the database ---------------------------------------------------------

    def rows_read(self, rows: int) -> None:
        self._rows_read += rows

    def read_gauges(
        self, store: RelayStore, shards: frozenset[int], *, any_blocked: bool, db: Guard
    ) -> None:
        """Read the backlog gauges of ``shards`` and the rows held per blocked topic, each only
        while it may have changed (through the loop's database guard); in exactly-once mode, set
        the progress-lag gauges (:meth:`progress_lag`) first."""
        if self._exactly_once:
            self.progress_lag(shards)
        if shards and self.wants_backlog():
            backlog = db("backlog", store.backlog)
            if backlog is not FAILED:
                self.backlog(backlog, shards)
        if self.wants_blocked(any_blocked):
            blocked = db("blocked topics", store.blocked_rows)
            if blocked is not FAILED:
                self.blocked(blocked)

    def progress_lag(self, shards: frozenset[int]) -> None:
        """Per shard of ``shards`` (those held): seconds since the oldest commit whose position
        PostgreSQL has not recorded was reported, 0 when none is."""
        now = self._clock()
        for gone in self._unrecorded.keys() - shards:  # reported after the shard was lost
            del self._unrecorded[gone]
        for shard in shards:
            waiting = self._unrecorded.get(shard)
            self.metrics.progress_lag.labels(str(shard)).set(now - waiting[0][1] if waiting else 0)

    def wants_backlog(self) -> bool:
        """Whether to read the backlog: rows were read since, or the last answer had some."""
        return bool(self._rows_read or self._backlog_seen)

    def backlog(self, backlog: list[ShardBacklog], shards: Iterable[int]) -> None:
        """Backlog gauges of the shards held."""
        self._rows_read = 0
        self._backlog_seen = bool(backlog)
        rows: dict[int, int] = {}
        lag: dict[int, float] = {}
        for item in backlog:
            rows[item.shard] = rows.get(item.shard, 0) + item.unpublished
            lag[item.shard] = max(lag.get(item.shard, 0.0), item.oldest_unpublished_seconds)
        for shard in shards:
            self.metrics.unpublished.labels(str(shard)).set(rows.get(shard, 0))
            self.metrics.lag.labels(str(shard)).set(lag.get(shard, 0.0))

    def wants_blocked(self, any_blocked: bool) -> bool:
        """Whether to read the blocked rows: keys are blocked, or were at the last reading."""
        return any_blocked or bool(self._blocked_gauged)

    def blocked(self, blocked: dict[str, int]) -> None:
        """Rows held per blocked topic."""
        for topic in self._blocked_gauged - blocked.keys():
            with contextlib.suppress(KeyError):
                self.metrics.blocked_rows.remove(topic)
        for topic, count in blocked.items():
            self.metrics.blocked_rows.labels(topic).set(count)
        self._blocked_gauged = set(blocked)
