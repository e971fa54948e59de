"""The relay loop: read leased shards by snapshot difference → produce → confirm → record.

The loop alone holds the store and the publisher (:mod:`oncely.relay.ports`); each job is a
part that owns its state and returns a decision the loop applies: the shards and their phase
(:mod:`~oncely.relay.shards`), leases (:mod:`~oncely.relay.leases`), reading and producing
(:mod:`~oncely.relay.reading`), delivery reports (:mod:`~oncely.relay.settle`), failures
(:mod:`~oncely.relay.failures`), progress (:mod:`~oncely.relay.progress`), parked keys and their
release (:mod:`~oncely.relay.parking`, :mod:`~oncely.relay.release`), metrics
(:mod:`~oncely.relay.meters`) and the read pace (:mod:`~oncely.relay.pace`). The rules it keeps,
each tested against real PostgreSQL and Kafka:

- Rows are never claimed or updated. A shard's progress moves only after every record of its
  pages has a successful delivery report, in one write for the pages acknowledged in the last
  20 ms (at once when they park keys or hold rows), fenced by the shard's lease epoch: a relay
  that lost the shard cannot move it (duplicates, never loss; ``progress_refused``).
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

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import sqlalchemy as sa

from oncely.failpoints import failpoint
from oncely.relay import failures, release, settle
from oncely.relay import reading as reading_
from oncely.relay.failures import Failures
from oncely.relay.leases import plan_tick
from oncely.relay.meters import GAUGE_INTERVAL, Meters
from oncely.relay.pace import Mode, Pace
from oncely.relay.parking import ParkedKeys, held_keys
from oncely.relay.ports import Housekeeper, Publisher, RelayStore
from oncely.relay.progress import Acknowledged, quiet, refused
from oncely.relay.shards import Failure, Page, Phase, Shard, ShardTable
from oncely.relay.signals import Signals
from oncely.relay.topics import TopicWatch, topic_error_state
from oncely.runtime.metrics import RelayMetrics
from oncely.runtime.process import Every
from oncely.runtime.retry import Backoff
from oncely.runtime.wakeup import Wakeup
from oncely.security import KafkaAuthenticationError
from oncely.settings import RelaySettings
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Rows read per second under which the relay waits for NOTIFYs, and from which it polls again
#: (see :mod:`oncely.relay.pace`): a NOTIFY per commit costs writers a global lock at commit.
_LISTEN_BELOW, _POLL_ABOVE = 500.0, 2000.0
#: Shards whose reads found nothing have their position recorded this often (seconds): a
#: crash only reads empty ranges again.
_QUIET_RECORD_INTERVAL = 30.0
#: While listening with records in flight, their delivery reports are served this often.
_REPORTS_WAIT = 0.005
#: A quiet relay waits at most this long for the reports of a read's records it sends at once
#: (librdkafka sends them only while its flush lasts, so not too short: usually ~1 ms).
_SEND_WAIT = 0.05
#: Progress is recorded at most this often (seconds): a crash replays what was acknowledged
#: since (duplicates), and a quiet service does not write progress after every few rows.
_RECORD_INTERVAL = 0.02
#: A blocked topic is asked about at least this often (seconds): one metadata request, so its
#: rows go out within seconds of the topic being created.
_TOPIC_CHECK_MAX = 5.0


class _Failed(enum.Enum):
    FAILED = "failed"


FAILED = _Failed.FAILED


@dataclass(slots=True)
class _Health:
    """When the loop last turned, and after a failed database call when it calls again."""

    heartbeat: float
    database_retry_at: float | None = None


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
        self.store = store
        self.settings = settings
        self.housekeeping = housekeeping
        self._clock = clock
        self._wakeup = wakeup
        self._publisher = publisher_factory()
        now = clock()
        self._shards = ShardTable(
            Backoff(
                first=settings.initial_backoff_seconds,
                maximum=settings.max_backoff_seconds,
                jitter=0.5,
            )
        )
        self._parked = ParkedKeys()
        self._failures = Failures(
            max_attempts=settings.max_attempts, delivery_timeout_ms=settings.delivery_timeout_ms
        )
        self._acknowledged = Acknowledged(interval=_RECORD_INTERVAL)
        self._topics = TopicWatch(
            probe=self._publisher.topic_state,
            backoff=Backoff(
                first=settings.initial_backoff_seconds,
                maximum=min(settings.max_backoff_seconds, _TOPIC_CHECK_MAX),
                jitter=0.5,
            ),
            clock=clock,
        )
        self._meters = Meters(metrics, signals)
        self._pace = Pace(
            listen_below=_LISTEN_BELOW,
            poll_above=_POLL_ABOVE,
            fallback=settings.poll_interval_seconds,
            window_start=now,
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
        return self.healthy() and self.database_ok and not self._publisher.brokers_down

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
        quiet_record = Every(_QUIET_RECORD_INTERVAL, clock=clock)
        gauges = Every(GAUGE_INTERVAL, clock=clock)
        purge = Every(self.settings.purge_interval_seconds, clock=clock)
        pace, publisher, wakeup = self._pace, self._publisher, self._wakeup
        while not stop.is_set():
            self._health.heartbeat = now = clock()
            if publisher.auth_failed is not None:
                break
            if self._database_waits(now):
                continue
            if tick.due():
                self._tick(quiet_record)
            if gauges.due():
                self._update_gauges()
            if purge.due():
                self.housekeeping.due()
            publisher.poll(0)
            self._settle()
            self._shards.wake(now)
            self._release_parked()
            if pace.mode is Mode.LISTENING and wakeup is not None and wakeup.pending():
                pace.ask()
            read, complete = 0, True
            if pace.guard is not None:
                self._check_guard()
            if pace.should_read(now):
                read, complete = self._read()
                pace.read_done(read, complete=complete, now=clock())
                self._meters.rows_read(read)
            self._pace_switch()
            if read and pace.mode is Mode.LISTENING and self.settings.linger_ms is None:
                # Quiet: no other rows will join these records, so they go out now (flush
                # ignores linger.ms) and their reports are served, rather than after linger.
                publisher.flush(_SEND_WAIT)
                self._settle()
            if read and (pace.mode is Mode.POLLING or not complete):
                continue
            if not pace.listens() or wakeup is None:
                publisher.poll(pace.poll)
            elif self._shards.in_flight.count:
                # Delivery reports only move progress (recorded every 20 ms): serve them
                # between waits, and wake at once for a commit.
                if wakeup.wait(_REPORTS_WAIT):
                    pace.ask()
            elif wakeup.wait(self._quiet_wait(tick)):
                pace.ask()
        self._drain()
        if publisher.auth_failed is not None:
            raise KafkaAuthenticationError.of(publisher.auth_failed)

    def _db(self, what: str, call: Callable[[], T]) -> T | _Failed:
        """``call()``, or :data:`FAILED` when the database failed: logged, the relay is not
        ready, and the loop only serves delivery reports until a retry time (no sleep)."""
        try:
            result = call()
        except (sa.exc.DBAPIError, psycopg.Error) as exc:
            retry_in = min(1.0, self.settings.poll_interval_seconds)
            self._health.database_retry_at = self._clock() + retry_in
            log.warning("database %s failed, retrying: %s", what, getattr(exc, "orig", exc))
            return FAILED
        self._health.database_retry_at = None
        return result

    def _database_waits(self, now: float) -> bool:
        """Whether a failed database call's retry time is still ahead (delivery reports are
        served meanwhile)."""
        retry_at = self._health.database_retry_at
        if retry_at is None or now >= retry_at:
            return False
        self._publisher.poll(min(retry_at - now, 0.1))
        return True

    def _quiet_wait(self, tick: Every) -> float:
        """How long a quiet relay with nothing in flight waits for a NOTIFY: until its fallback
        read, its tick, or the recording of progress acknowledged since the last record."""
        now, pace = self._clock(), self._pace
        wait = min(
            pace.fallback - (now - pace.last_read), tick.remaining(), self._acknowledged.wait(now)
        )
        return max(0.0, wait)

    def _pace_switch(self) -> None:
        """Switch between polling and listening when the rate of rows read asks for it."""
        mode = self._pace.switch(self._clock())
        if mode is None or (mode is Mode.LISTENING and self._wakeup is None):
            return
        guard = self._db(
            f"switch to {mode.value}", functools.partial(self._mark, mode is Mode.LISTENING)
        )
        if guard is not FAILED:
            self._pace.switched(mode, guard=guard)
            log.debug("relay %s", mode.value)

    def _mark(self, listening: bool) -> int | None:
        """Listen for NOTIFYs and mark the relay asleep (or neither); listening: the xmax of a
        snapshot taken after the mark was committed."""
        if self._wakeup is not None:
            if listening:
                self._wakeup.listen()
            else:
                self._wakeup.unlisten()
        self.store.sleep(asleep=listening)
        return self.store.snapshot()[0].xmax if listening else None

    def _check_guard(self) -> None:
        """Listening since a moment ago: have the transactions running then ended?"""
        taken = self._db("snapshot", self.store.snapshot)
        if taken is not FAILED:
            self._pace.guard_passed(taken[0].xmin)

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
            self._forget(number)
        shards.renewed(started + lease)
        shards.hand_off(plan.hand_off)
        if plan.take:
            self._acquire(plan.take, started)
        if quiet_record.due():
            self._record_quiet(shards)
        self._refresh_parked()

    def _acquire(self, wanted: int, started: float) -> None:
        def take() -> tuple[list[ShardProgress], list[Parking]]:
            leases = self.store.acquire(wanted=wanted, lease_seconds=self.settings.lease_seconds)
            return leases, self.store.parked([lease.shard for lease in leases]) if leases else []

        taken = self._db("lease", take)
        if taken is FAILED or not taken[0]:
            return
        leases, parked = taken
        for lease in leases:
            self._shards.take(lease, lease_deadline=started + self.settings.lease_seconds)
        self._parked.add(parked)
        self._pace.ask()
        self._meters.took(leases)
        log.info("took shards %s", sorted(lease.shard for lease in leases))

    def _forget(self, number: int) -> None:
        """Drop a shard without recording anything (it was lost, or has been given back)."""
        self._shards.drop(number)
        self._acknowledged.drop(number)
        self._parked.drop_shard(number)
        self._meters.forget(number)

    def _hand_off(self) -> None:
        """Give back shards over the fair share once everything read from them is recorded."""
        ready = self._shards.ready_to_hand_off()
        if not ready:
            return
        self._record_quiet(ready)
        released = self._db(
            "hand-off", lambda: self.store.release([(s.shard, s.epoch) for s in ready])
        )
        if released is FAILED:
            return
        for shard in ready:
            self._forget(shard.shard)
        if released:
            log.info("handed off shards %s", sorted(released))
            self._meters.handed_off(released)

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
        """Read one page per group of shards at the same position; return the rows read and
        whether the reads reached the end of what was committed (every shard held was read,
        none had more left: nothing is left to read until the next commit)."""
        room = self.settings.max_in_flight - self._shards.in_flight.count
        if room <= 0:
            return 0, False
        fresh: Snapshot | None = None
        total = 0
        groups = self._shards.groups(now=self._clock(), margin=self.settings.lease_seconds / 3)
        complete = sum(len(members) for members in groups.values()) == len(self._shards) - len(
            self._shards.handing_off()
        )
        for cursor, members in groups.items():
            if cursor.reading is None and fresh is None:
                taken = self._db("snapshot", self.store.snapshot)
                if taken is FAILED:
                    return total, False
                fresh = taken[0]
            reading = cursor.reading or fresh
            assert reading is not None
            read = self._read_page(cursor, members, reading, room)
            if read is None:
                return total, False
            rows, ended = read
            total += rows
            room -= rows
            complete = complete and ended
            if room <= 0:
                return total, False
        return total, complete

    def _read_page(
        self, cursor: Progress, members: list[Shard], reading: Snapshot, room: int
    ) -> tuple[int, bool] | None:
        """Read ``members`` from ``cursor`` and produce what was read, a page per shard
        (:mod:`oncely.relay.reading`); return how many rows and whether ``reading`` is read to
        its end, or ``None`` to read nothing more this turn (the database failed)."""
        # Each page of a read scans what is left of the snapshot difference: while pages
        # come back full (a large backlog), ask for twice as many, up to half the
        # in-flight bound, so a backlog costs a few scans rather than one per 1,000 rows.
        grown = min(s.page_size or self.settings.batch_size for s in members)
        page_size = min(room, grown)
        rows = self._db(
            "read",
            lambda: self.store.read(
                [s.shard for s in members],
                done=cursor.done,
                reading=reading,
                after_seq=cursor.after_seq,
                page_size=page_size,
            ),
        )
        if rows is FAILED:
            return None
        topics = self._topics
        blocked = frozenset(t for t in {row.topic for row in rows} if topics.is_blocked(t))
        parked = self._parked
        read = reading_.cut(
            rows,
            cursor=cursor,
            reading=reading,
            page_size=page_size,
            members=members,
            waits=lambda row: (
                row.delayed or (bool(parked) and parked.waits(row)) or row.topic in blocked
            ),
            suspects=self._failures.suspects,
            limit_of=self._publisher.max_message_bytes,
        )
        if read is None:
            return 0, False
        cap = max(self.settings.batch_size, self.settings.max_in_flight // 2)
        for shard in read.members:
            shard.page_size = min(cap, grown * 2) if len(read.rows) == page_size else 0
        pages: dict[int, Page] = {}
        if read.rows:
            failpoint("relay.after_read")
            waits = functools.partial(parked.place, blocked=blocked, state_of=topics.state)
            pages, refused_now = reading_.produce(
                read,
                in_flight=self._shards.in_flight,
                deadline=self._clock() + self._delivery_timeout,
                send=self._publisher.produce,
                waits=waits if parked or blocked or any(r.delayed for r in read.rows) else None,
            )
            for row, error in refused_now:
                self._meters.produce_error(row.topic, row.shard, error.name())
        for shard in read.members:
            shard.cursor = read.ends
            page = pages.get(shard.shard)
            if page is not None and page.has_writes:
                shard.add(page)
            elif shard.pages:  # its progress is recorded after the pages in flight
                shard.add(Page(shard.shard, read.ends, self._shards.in_flight))
        return len(read.rows), read.ends.reading is None

    # -- settling, failures and progress -------------------------------------------------------

    def _settle(self) -> None:
        """Record acknowledged pages; replay the shards whose delivery failed or is overdue."""
        for row, error in settle.take_errors(self._shards):
            self._meters.produce_error(row.topic, row.shard, error.name())
            state = topic_error_state(error)
            if state is not None:
                self._topics.block(row.topic, state)
        if self._publisher.fatal is not None:
            log.warning("fatal producer error, recreating the producer and replaying")
            self._recreate("fatal")
            return
        now = self._clock()
        settled = settle.settle(self._shards, now)
        for page in settled.acknowledged:
            if page.produced:
                self._publisher.reachable()
                self._meters.acknowledged(page)
                self._failures.published(page.produced)
        for progress in settled.progress:
            self._acknowledged.add(progress)
        failed: dict[int, Failure | None] = dict(settled.failed)
        if settled.overdue:
            failed.update(self._overdue(settled.overdue, now))
        self._meters.flush()
        if self._acknowledged.due(self._clock(), urgent=bool(settled.parked or settled.held)):
            self._record_acknowledged(list(settled.parked.values()), settled.held)
        if failed:
            self._replay(failed)
        self._hand_off()

    def _overdue(self, pages: list[Page], now: float) -> dict[int, Failure | None]:
        """The shards whose oldest page is unconfirmed past ``delivery_timeout_ms`` and replay
        (``None``: no failure report): with every broker down all of them (the producer is then
        recreated), else as :func:`oncely.relay.failures.overdue` says; the others wait on."""
        for page in pages:
            topic = page.produced[0].topic if page.produced else ""
            self._meters.produce_error(topic, page.shard, "_MSG_TIMED_OUT")
        if self._publisher.brokers_down:
            return dict.fromkeys(page.shard for page in pages)
        timeout_ms = self.settings.delivery_timeout_ms
        plan = failures.overdue(pages, topics=self._topics, timeout_ms=timeout_ms)
        for page in plan.waiting:
            page.deadline = now + timeout_ms / 1000
        return dict.fromkeys(plan.replay)

    def _replay(self, failed: dict[int, Failure | None]) -> None:
        """Replay the failed shards from their recorded progress (:mod:`oncely.relay.failures`
        judges each); no other shard is touched. With every broker down past the delivery
        timeout, the producer cannot go on: it is recreated and every shard replays."""
        if any(failure is None for failure in failed.values()) and self._publisher.brokers_down:
            log.warning(
                "delivery timed out after %d ms with every broker down, recreating the producer",
                self.settings.delivery_timeout_ms,
            )
            self._recreate("brokers_down")
            return
        backoff = {shard: self._judge(shard, failure) for shard, failure in failed.items()}
        if self._acknowledged:
            self._record_acknowledged()  # replay only what was not acknowledged
        now = self._clock()
        for number, delayed in backoff.items():
            shard = self._shards.get(number)
            if shard is not None:
                self._reset(shard, backoff=delayed, now=now)

    def _judge(self, shard: int, failure: Failure | None) -> bool:
        """Apply the verdict on a shard's failure; whether its replay waits (backoff)."""
        verdict = self._failures.judge(shard, failure)
        if failure is not None and verdict.forget_limits:
            self._publisher.forget_limits(failure.row.topic)
        if failure is not None and verdict.dead_letter is not None:
            self._dead_letter(failure.row, verdict.dead_letter)
        return verdict.backoff

    def _recreate(self, reason: str) -> None:
        """The producer cannot go on: record what is acknowledged, start a new producer (every
        outstanding record fails) and replay every shard from its recorded progress."""
        self._meters.recreated(reason)
        if self._acknowledged:
            self._record_acknowledged()
        self._publisher.recreate()
        self._reset_all()

    def _reset_all(self) -> None:
        now = self._clock()
        for shard in list(self._shards):
            self._reset(shard, backoff=True, now=now)

    def _reset(self, shard: Shard, *, backoff: bool, now: float) -> None:
        """Drop what ``shard`` has in flight and read it again from its recorded progress
        (after a backoff); keys its dropped pages parked are not parked any more."""
        self._pace.ask()
        self._meters.replayed(shard.shard)
        self._acknowledged.drop(shard.shard)
        self._parked.drop_pages(self._shards.reset(shard, backoff=backoff, now=now))

    def _dead_letter(self, row: OutboxRow, error: str) -> None:
        parking = Parking(row.topic, row.aggregateid, row.shard, row.id, "dead", error=error)
        epoch = self._shards.epoch_of(row.shard)
        if self._db("dead letter", lambda: self.store.park([(parking, epoch)])) is FAILED:
            return
        self._parked.park(parking)
        self._failures.dead(row.id)
        self._meters.dead(row.topic)
        log.error(
            "row dead-lettered, its key is parked: %s",
            error,
            extra={"id": str(row.id), "topic": row.topic, "key": row.aggregateid},
        )

    def _record_acknowledged(
        self, parked: list[tuple[Parking, int]] | None = None, held: list[Held] | None = None
    ) -> None:
        """Record the progress of the acknowledged pages not yet recorded (with the keys they
        parked and the rows they held)."""
        failpoint("relay.after_ack_before_record")
        self._record(self._acknowledged.take(self._clock()), parked or [], held or [])

    def _record_quiet(self, shards: Iterable[Shard]) -> None:
        """Record the position of ``shards`` whose last reads found nothing to publish."""
        positions = quiet(shards)
        if positions:
            self._record(positions, [], [])

    def _record(
        self, progress: list[ShardProgress], parked: list[tuple[Parking, int]], held: list[Held]
    ) -> None:
        """Write progress; a shard taken over is forgotten and the rest written again. When the
        database fails, every shard replays from its recorded progress."""
        recorded = self._db(
            "progress", lambda: self.store.record(progress, parked=parked, held=held)
        )
        if recorded is not FAILED:
            split = refused(progress, parked, held, recorded=recorded)
            if split is not None:
                self._meters.refused(split.shards)
                log.warning("progress refused for shards %s: taken over", sorted(split.shards))
                for number in split.shards:
                    if number in self._shards:
                        self._meters.lost(number)  # found here before the next heartbeat
                        self._forget(number)
                progress = split.progress
                recorded = self._db(
                    "progress",
                    lambda: self.store.record(split.progress, parked=split.parked, held=split.held),
                )
        if recorded is FAILED:
            self._reset_all()
            return
        for item in progress:
            self._acknowledged.drop(item.shard)
            self._shards.recorded(item)
        self._meters.recorded(progress)

    # -- parked keys ---------------------------------------------------------------------------

    def _release_parked(self) -> None:
        """Publish the rows of keys an operator released, whose delay passed or whose topic
        exists again, in order: the due keys of a shard together, once it has nothing in
        flight and its progress is recorded."""
        if not self._parked:
            self._shards.releasing(frozenset())
            return
        due = self._parked.due(self._topics.is_blocked)
        self._shards.releasing(frozenset(due))
        for number, parkings in due.items():
            shard = self._shards.get(number)
            if shard is None or shard.pages or shard.phase is not Phase.RELEASING:
                continue
            if number in self._acknowledged:
                self._record_acknowledged()  # released on the next turn
                continue
            self._release(shard, parkings)

    def _release(self, shard: Shard, parkings: list[Parking]) -> None:
        """Publish parked keys' rows and unpark each key whose rows all went out
        (:mod:`oncely.relay.release`); a key whose rows failed stays parked, and the shard
        waits (backoff) before the next try."""
        outcome = self._db(
            "release",
            lambda: release.release(
                self.store,
                self._publisher,
                parkings,
                timeout=self._delivery_timeout + 5,
                clock=self._clock,
            ),
        )
        if outcome is FAILED:
            return
        for again in outcome.again:
            if again.block is not None:
                self._topics.block(*again.block)
            if again.dead is not None:
                park = functools.partial(self.store.park_failed, again.parking, error=again.dead)
                if self._db("dead letter", park) is FAILED:
                    return
                self._parked.dead(again.parking, again.dead)
        for unpark in outcome.unpark:
            self._meters.published_alone(unpark.rows)
            released = self._db(
                "release",
                functools.partial(
                    self.store.unpark,
                    unpark.parking,
                    epoch=shard.epoch,
                    published_to=unpark.published_to,
                ),
            )
            if released is FAILED:
                return
            if released:
                self._parked.released(unpark.parking)
                self._meters.released(shard.shard)
                log.info(
                    "key released (%s): %d row(s) published",
                    unpark.parking.request or unpark.parking.reason,
                    len(unpark.rows),
                    extra={"topic": unpark.parking.topic, "key": unpark.parking.aggregateid},
                )
        if outcome.failed:
            self._reset(shard, backoff=True, now=self._clock())

    # -- gauges and stop -----------------------------------------------------------------------

    def _update_gauges(self) -> None:
        """Backlog gauges of the shards held, and rows held per blocked topic (each read only
        while it may have changed)."""
        meters = self._meters
        if len(self._shards) and meters.wants_backlog():
            backlog = self._db("backlog", self.store.backlog)
            if backlog is not FAILED:
                meters.backlog(backlog, self._shards.numbers())
        if meters.wants_blocked(self._parked.any_blocked()):
            blocked = self._db("blocked topics", self.store.blocked_rows)
            if blocked is not FAILED:
                meters.blocked(blocked)

    def _drain(self) -> None:
        """Stop reading, wait (bounded) for reports, record, give every shard back."""
        clock, shards, publisher = self._clock, self._shards, self._publisher
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
            self._settle()
            if len(shards) == before and any(s.pages for s in shards):
                continue
            if all(not s.pages for s in shards):
                self._hand_off()
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
