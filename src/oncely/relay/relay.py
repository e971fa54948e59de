"""The relay loop: read leased shards by snapshot difference → produce → confirm → record.

The loop alone holds the store and the publisher (:mod:`oncely.relay.ports`) and hands them to
the parts that call them on its behalf; each job is a part that owns its state and returns a
decision: the shards and their phase (:mod:`~oncely.relay.shards`), leases
(:mod:`~oncely.relay.leases`), reading and producing (:mod:`~oncely.relay.reading`), delivery
reports (:mod:`~oncely.relay.settle`), failures (:mod:`~oncely.relay.failures`), progress
(:mod:`~oncely.relay.progress`), parked keys and their release (:mod:`~oncely.relay.parking`,
:mod:`~oncely.relay.release`), metrics (:mod:`~oncely.relay.meters`) and the read pace
(:mod:`~oncely.relay.pace`, :mod:`~oncely.relay.listening`). What delivery reports lead to
(record, replay, dead-letter) is applied by :mod:`~oncely.relay.outcomes`. The rules it keeps,
each tested against real PostgreSQL and Kafka:

- Rows are never claimed or updated. A shard's progress moves only after every record of its
  pages has a successful delivery report, in one write for the pages acknowledged in the last
  :data:`~oncely.relay.progress.RECORD_INTERVAL` (at once when they park keys or hold rows),
  fenced by the shard's lease epoch: a relay that lost the shard cannot move it (duplicates,
  never loss; ``progress_refused``).
- Per-key order = commit order: a key maps to one shard, which one relay reads at a time;
  within a read rows go out in ``seq`` order, a key to one partition, by an idempotent producer.
- A failure costs only its shard, which replays from its recorded progress (``shard_replays``);
  the producer is recreated only when it cannot go on (``producer_recreations``). A missing or
  forbidden topic blocks only its own keys (:mod:`~oncely.relay.topics`), never dead-letters,
  and its rows go out once it exists. A row that fails for good is dead-lettered and parks its
  key; a delayed row parks its key until then; later rows of a parked key are held.
- Shards are leased on the database clock and shared fairly among the live relays.
- Database or broker outages never crash the loop (a failed database call makes it serve
  delivery reports only, until a retry time); refused credentials stop it
  (:class:`~oncely.security.KafkaAuthenticationError`) after giving back its shards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import sqlalchemy as sa

from oncely.relay import listening, reading, release, takeover
from oncely.relay.leases import plan_tick
from oncely.relay.meters import GAUGE_INTERVAL, Meters
from oncely.relay.outcomes import Outcomes
from oncely.relay.pace import LISTEN_BELOW, POLL_ABOVE, Mode, Pace
from oncely.relay.parking import ParkedKeys, held_keys
from oncely.relay.ports import FAILED, Failed, Housekeeper, Publisher, RelayStore, Sources
from oncely.relay.progress import QUIET_RECORD_INTERVAL
from oncely.relay.shards import Phase, Shard, ShardTable
from oncely.relay.signals import Signals
from oncely.relay.topics import TOPIC_CHECK_MAX, TopicWatch
from oncely.runtime.metrics import RelayMetrics
from oncely.runtime.process import Every
from oncely.runtime.retry import Backoff
from oncely.runtime.wakeup import Wakeup
from oncely.security import KafkaAuthenticationError
from oncely.settings import RelaySettings
from oncely.storage.errors import MISSING_TABLES, missing_tables
from oncely.storage.stores.outbox.relay import Parking, ShardProgress

log = logging.getLogger(__name__)

T = TypeVar("T")

#: While listening with records in flight, their delivery reports are served this often.
_REPORTS_WAIT = 0.005
#: A quiet relay waits at most this long for the reports of a read's records it sends at once
#: (librdkafka sends them only while its flush lasts, so not too short: usually ~1 ms).
_SEND_WAIT = 0.05


@dataclass(slots=True)
class _Health:
    """When the loop last turned, and after a failed database call when it calls again."""

    heartbeat: float
    database_retry_at: float | None = None
    #: The last database call found none of oncely's tables (said once, until they appear).
    tables_missing: bool = False


class Relay:
    """One relay process's loop; ``run(stop)`` returns after a graceful drain."""

    def __init__(
        self,
        *,
        store: RelayStore,
        publisher_factory: Callable[[], Publisher],
        settings: RelaySettings,
        metrics: RelayMetrics,
        housekeeping: Housekeeper,
        wakeup: Wakeup | None = None,
        signals: Signals | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``housekeeping`` runs the purge timer off the loop
        (:func:`~oncely.relay.service.build_relay` gives the relay's); ``signals`` receives
        what the relay did, for tests to wait on; ``clock`` is the monotonic clock."""
        self.settings = settings
        self.housekeeping = housekeeping
        self._clock = clock
        self._wakeup = wakeup
        publisher = publisher_factory()
        now = clock()
        self._shards = ShardTable(
            Backoff(
                first=settings.initial_backoff_seconds,
                maximum=settings.max_backoff_seconds,
                jitter=0.5,
            )
        )
        self._parked = ParkedKeys()
        topics = TopicWatch(
            probe=publisher.topic_state,
            backoff=Backoff(
                first=settings.initial_backoff_seconds,
                maximum=min(settings.max_backoff_seconds, TOPIC_CHECK_MAX),
                jitter=0.5,
            ),
            clock=clock,
        )
        self._sources = Sources(store, publisher, topics, settings)
        self._meters = Meters(metrics, signals, exactly_once=settings.exactly_once, clock=clock)
        self._pace = Pace(
            listen_below=LISTEN_BELOW,
            poll_above=POLL_ABOVE,
            fallback=settings.poll_interval_seconds,
            window_start=now,
        )
        self._outcomes = Outcomes(
            settings=settings,
            topics=topics,
            shards=self._shards,
            parked=self._parked,
            meters=self._meters,
            pace=self._pace,
            db=self._db,
            clock=clock,
        )
        self._health = _Health(heartbeat=now)

    # -- health --------------------------------------------------------------------------------

    @property
    def metrics(self) -> RelayMetrics:
        return self._meters.metrics

    @property
    def signals(self) -> Signals | None:
        return self._meters.signals

    @property
    def database_ok(self) -> bool:
        """The last database call worked."""
        return self._health.database_retry_at is None

    def healthy(self) -> bool:
        """The loop turned recently (it is not stuck)."""
        return self._clock() - self._health.heartbeat < max(30.0, self.settings.lease_seconds)

    def ready(self) -> bool:
        """The last database call worked and the broker is reachable."""
        return self.healthy() and self.database_ok and not self._sources.publisher.brokers_down

    @property
    def store(self) -> RelayStore:
        return self._sources.store

    @property
    def shards(self) -> frozenset[int]:
        """The shards this relay holds now."""
        return self._shards.numbers()

    @property
    def _delivery_timeout(self) -> float:
        return self.settings.delivery_timeout_ms / 1000

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set, then drain; never raises for broker or database faults.

        Raises :class:`KafkaAuthenticationError` (after giving back its shards) when the broker
        refuses the credentials.
        """
        clock = self._clock
        tick = Every(self.settings.lease_seconds / 3, clock=clock)
        quiet_record = Every(QUIET_RECORD_INTERVAL, clock=clock)
        gauges = Every(GAUGE_INTERVAL, clock=clock)
        purge = Every(self.settings.purge_interval_seconds, clock=clock)
        pace, publisher, wakeup = self._pace, self._sources.publisher, self._wakeup
        while not stop.is_set():
            self._health.heartbeat = now = clock()
            if publisher.auth_failed is not None:
                break
            if self._database_waits(now):
                continue
            if tick.due():
                self._tick(quiet_record)
            if gauges.due():
                self._meters.read_gauges(
                    self.store,
                    self._shards.numbers(),
                    any_blocked=self._parked.any_blocked(),
                    db=self._db,
                )
            if purge.due():
                self.housekeeping.due()
            publisher.poll(0)
            self._outcomes.settle(self._sources)
            self._shards.wake(now)
            self._release_parked()
            if pace.mode is Mode.LISTENING and wakeup is not None and wakeup.pending():
                pace.ask()
            read, complete = 0, True
            if pace.guard is not None:
                listening.check_guard(pace, self.store, db=self._db)
            if pace.should_read(now):
                read, complete = self._read()
                pace.read_done(read, complete=complete, now=clock())
                self._meters.rows_read(read)
            listening.switch(pace, self.store, wakeup, now=clock(), db=self._db)
            if read and pace.mode is Mode.LISTENING and self.settings.linger_ms is None:
                # Quiet: no other rows will join these records, so they go out now (flush
                # ignores linger.ms) and their reports are served, rather than after linger.
                publisher.flush(_SEND_WAIT)
                self._outcomes.settle(self._sources)
            if read and (pace.mode is Mode.POLLING or not complete):
                continue
            if not pace.listens() or wakeup is None:
                publisher.poll(pace.poll)
            elif self._shards.in_flight.count:
                # Delivery reports only move progress (recorded every
                # progress.RECORD_INTERVAL): serve them between waits, and wake at once for a
                # commit.
                if wakeup.wait(_REPORTS_WAIT):
                    pace.ask()
            elif wakeup.wait(self._quiet_wait(tick)):
                pace.ask()
        self._drain()
        if publisher.auth_failed is not None:
            raise KafkaAuthenticationError.of(publisher.auth_failed)

    def _db(self, what: str, call: Callable[[], T]) -> T | Failed:
        """``call()``, or :data:`FAILED` when the database failed: logged, the relay is not
        ready, and the loop only serves delivery reports until a retry time (no sleep)."""
        try:
            result = call()
        except (sa.exc.DBAPIError, psycopg.Error) as exc:
            retry_in = min(1.0, self.settings.poll_interval_seconds)
            self._health.database_retry_at = self._clock() + retry_in
            if not missing_tables(exc):
                log.warning("database %s failed, retrying: %s", what, getattr(exc, "orig", exc))
            elif not self._health.tables_missing:
                self._health.tables_missing = True
                log.error("%s; not ready until then", MISSING_TABLES)
            return FAILED
        self._health.database_retry_at = None
        if self._health.tables_missing:
            self._health.tables_missing = False
            log.warning("oncely's tables exist now: going on")
        return result

    def _database_waits(self, now: float) -> bool:
        """Whether a failed database call's retry time is still ahead (delivery reports are
        served meanwhile)."""
        retry_at = self._health.database_retry_at
        if retry_at is None or now >= retry_at:
            return False
        self._sources.publisher.poll(min(retry_at - now, 0.1))
        return True

    def _quiet_wait(self, tick: Every) -> float:
        """How long a quiet relay with nothing in flight waits for a NOTIFY: until its fallback
        read, its tick, or the recording of progress acknowledged since the last record."""
        now, pace = self._clock(), self._pace
        wait = min(
            pace.fallback - (now - pace.last_read),
            tick.remaining(),
            self._outcomes.acknowledged.wait(now),
        )
        return max(0.0, wait)

    # -- leases --------------------------------------------------------------------------------

    def _tick(self, quiet_record: Every) -> None:
        """Heartbeat, renew, take or hand off shards to the fair share; record quiet shards."""
        lease = self.settings.lease_seconds
        shards = self._shards
        started = self._clock()
        membership = self._db(
            "lease renewal",
            lambda: self.store.heartbeat(
                ttl_seconds=lease, asleep=self._pace.mode is Mode.LISTENING, leases=shards.leases()
            ),
        )
        if membership is FAILED:
            return
        plan = plan_tick(
            shards.numbers(),
            handing_off=shards.handing_off(),
            kept=membership.kept,
            shards=membership.shards,
            alive=membership.alive,
        )
        for number in plan.lost:
            log.warning("lost shard %d to another relay", number)
            self._meters.lost(number)
            self._outcomes.forget(self._sources, number)
        shards.renewed(started + lease)
        shards.hand_off(plan.hand_off)
        if plan.take:
            self._acquire(plan.take, started)
        if quiet_record.due():
            self._outcomes.record_quiet(self._sources, shards)
        self._refresh_parked()

    def _acquire(self, wanted: int, started: float) -> None:
        def take() -> tuple[list[ShardProgress], list[Parking]]:
            leases = self.store.acquire(wanted=wanted, lease_seconds=self.settings.lease_seconds)
            return leases, self.store.parked([lease.shard for lease in leases]) if leases else []

        taken = self._db("lease", take)
        if taken is FAILED or not taken[0]:
            return
        leases, parked = taken
        leases = takeover.in_kafka(self._sources, leases, db=self._db)
        if leases and self._clock() - started > self.settings.lease_seconds / 3:
            # Taking them in Kafka waited for their previous owners' transactions to end.
            started = self._clock()
            leases = takeover.renew(
                self._sources,
                leases,
                held=self._shards.leases(),
                asleep=self._pace.mode is Mode.LISTENING,
                db=self._db,
            )
        if not leases:
            return
        for lease in leases:
            self._shards.take(lease, lease_deadline=started + self.settings.lease_seconds)
        self._parked.add(parked)
        self._pace.ask()
        self._meters.took(leases)
        log.info("took shards %s", sorted(lease.shard for lease in leases))

    def _refresh_parked(self) -> None:
        """Read the parked keys of the shards held again, and count the shards and keys. Nothing
        to read when none are parked: only this relay parks keys of the shards it holds, and it
        read their parked keys when it took them."""
        numbers = self._shards.numbers()
        counts: dict[int, int] = {}
        if numbers and not self._parked:
            counts = dict.fromkeys(numbers, 0)
        elif numbers:
            parked = self._db("parked keys", lambda: self.store.parked(sorted(numbers)))
            if parked is not FAILED:
                pending = (page for shard in self._shards for page in shard.pages)
                self._parked.refresh(parked, pending=pending)
                counts = held_keys(parked, numbers)
        self._meters.shards(len(numbers), counts)

    # -- reading and producing -----------------------------------------------------------------

    def _read(self) -> tuple[int, bool]:
        """Read and produce (:func:`oncely.relay.reading.read`); the rows read and whether
        nothing is left to read until the next commit."""
        done = reading.read(
            self._sources,
            self._shards,
            waiting=self._parked,
            suspects=self._outcomes.failures.suspects,
            now=self._clock,
            db=self._db,
        )
        for row, error in done.refused:
            self._meters.produce_error(row.topic, row.shard, error.name())
        return done.rows, done.complete

    # -- parked keys ---------------------------------------------------------------------------

    def _release_parked(self) -> None:
        """Publish the rows of keys an operator released, whose delay passed or whose topic
        exists again, in order: the due keys of a shard together, once it has nothing in
        flight and its progress is recorded."""
        if not self._parked:
            self._shards.releasing(frozenset())
            return
        due = self._parked.due(self._sources.topics.is_blocked)
        self._shards.releasing(frozenset(due))
        for number, parkings in due.items():
            shard = self._shards.get(number)
            if shard is None or shard.pages or shard.phase is not Phase.RELEASING:
                continue
            if number in self._outcomes.acknowledged:
                self._outcomes.record_acknowledged(self._sources)  # released on the next turn
                continue
            self._release(shard, parkings)

    def _release(self, shard: Shard, parkings: list[Parking]) -> None:
        """Publish parked keys' rows (:mod:`oncely.relay.release`); the outcome is applied by
        :meth:`Outcomes.released`."""
        outcome = self._db(
            "release",
            lambda: release.release(
                self.store,
                self._sources.publisher,
                parkings,
                position=ShardProgress(shard.shard, shard.epoch, shard.committed or shard.recorded),
                timeout=self._delivery_timeout + 5,
                clock=self._clock,
            ),
        )
        if outcome is not FAILED:
            self._outcomes.released(self._sources, shard, outcome)

    # -- stop -----------------------------------------------------------------------

    def _drain(self) -> None:
        """Stop reading, wait (bounded) for reports, record, give every shard back."""
        clock, shards, publisher = self._clock, self._shards, self._sources.publisher
        deadline = clock() + self.settings.shutdown_timeout_seconds
        shards.hand_off()
        while (
            len(shards)
            and publisher.auth_failed is None
            and publisher.fatal is None
            and clock() < deadline
        ):
            publisher.flush(min(0.5, max(0.0, deadline - clock())))
            before = len(shards)
            self._outcomes.settle(self._sources)
            if len(shards) == before and any(s.pages for s in shards):
                continue
            if all(not s.pages for s in shards):
                self._outcomes.hand_off(self._sources)
        unanswered = len(shards)
        self.housekeeping.join(max(0.0, deadline - clock()))
        try:
            self.store.release(shards.leases())
            self.store.leave()
        except sa.exc.DBAPIError as exc:
            log.warning("could not give back %d shards: %s", unanswered, exc.orig)
        self._meters.flush()
        self.store.close()
        if self._wakeup is not None:
            self._wakeup.close()
        log.info("relay stopped", extra={"unrecorded_shards": unanswered})
