"""The relay loop: read leased shards by snapshot difference → produce → confirm → record.

Rules the loop keeps (each is tested against real PostgreSQL and Kafka):

- Rows are never claimed or updated. Each shard's progress (a snapshot all of whose rows are
  acknowledged, and the position inside the newer snapshot being read) moves only after every
  record of its pages has a successful delivery report, in one write for all the pages
  acknowledged in the last 20 ms (at once when they park keys or hold rows); the write is fenced by
  the shard's lease epoch, so a relay that lost the shard (paused, partitioned) cannot move it:
  it may cause duplicates, never loss (counted in ``progress_refused``).
- Per-key order = commit order: a key always maps to one shard, which one relay reads at a time;
  within a read rows go out in ``seq`` order, the same key goes to the same partition, and the
  producer is idempotent. A read becomes one page per shard, acknowledged on its own.
- A failure costs only the rows it concerns: a failed (or overdue) delivery replays only the
  shard that holds the row from its recorded progress (duplicates, in order); every other shard
  keeps flowing with no pause and no replay. The producer is recreated only when it cannot go
  on (a fatal error, or every broker gone past the delivery timeout), counted in
  ``producer_recreations``; every replay is counted in ``shard_replays``.
- A topic that does not exist (or that the relay may not describe) is *blocked*
  (:mod:`oncely.relay.topics`): the first row of each of its keys is parked as ``blocked``
  and the later ones held, nothing is produced to it, and the broker's metadata is asked again
  with backoff (at most every 5 s); once the topic exists its keys are released and their rows
  published, in order, with no operator action. A blocked topic never dead-letters: it is a
  deployment mistake, not a bad row.
- A row that fails for good (too large, or refused after ``max_attempts``) is dead-lettered and
  parks its key; a row whose ``available_at`` is ahead parks its key until then. Rows of a
  parked key read later are held (recorded with the page) and published, in order, when the key
  is released (``oncely dead requeue|skip``, the delay passing, or the topic appearing). A row
  the broker may refuse (it failed before, or is over its topic's size limit) is produced alone
  once its shard has nothing in flight, so a refusal is its own; only its shard waits for it.
- Shards are leased on the database clock and shared fairly among the live relays: a relay
  over its share hands shards off after recording them, one under it takes free or expired
  shards, bumping their epoch. Leases are renewed while the relay lives, so they can be short.
- Wake-up (:mod:`oncely.relay.pace`): while rows flow fast the loop polls tightly (1 ms after
  rows, up to 4 ms) and staging sends no NOTIFY; under 500 rows/s it marks itself asleep,
  staging NOTIFYs at each commit and the loop reads only when one arrives (or every
  ``poll_interval_seconds``), and sends the records of each read at once instead of
  lingering (unless ``linger_ms`` is configured); from 2,000 rows/s it polls again. An idle
  relay sends a heartbeat every third of its lease and little else.
- Database or broker outages never crash the loop; refused credentials stop it
  (:class:`~oncely.security.KafkaAuthenticationError`) after giving back its shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from uuid import UUID

import psycopg
import sqlalchemy as sa
from confluent_kafka import KafkaError, Message

from oncely.failpoints import failpoint
from oncely.relay import delivery
from oncely.relay.extent import extent, first_suspect
from oncely.relay.housekeeping import Housekeeping
from oncely.relay.pace import Mode, Pace
from oncely.relay.publisher import Publisher
from oncely.relay.shares import rebalance
from oncely.relay.topics import TopicState, TopicWatch, topic_error_state
from oncely.runtime.metrics import RelayMetrics
from oncely.runtime.process import Every
from oncely.runtime.retry import Backoff
from oncely.runtime.wakeup import Wakeup
from oncely.security import KafkaAuthenticationError
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, RelayStore, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

log = logging.getLogger(__name__)

_GAUGE_INTERVAL = 5.0
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


class _InFlight:
    """Records produced and not yet reported, over every page (shared by the pages)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


@dataclass(frozen=True, slots=True)
class _Failure:
    """A shard's first failed row of a page; ``own``: nothing else of its shard was in flight
    (produced alone, or refused at once), so the error is the row's own."""

    row: OutboxRow
    error: KafkaError
    own: bool


@dataclass(eq=False)
class _Page:
    """One shard's rows of one read, produced together; its progress moves when all are acked."""

    shard: int
    ends: Progress
    in_flight: _InFlight
    rows: int = 0
    outstanding: int = 0
    #: The rows produced, in order (until the page is counted as published).
    produced: list[OutboxRow] = field(default_factory=list)
    #: Failed delivery reports not yet looked at (see Relay._take_errors).
    errors: list[tuple[KafkaError, Message | None]] = field(default_factory=list)
    failure: _Failure | None = None
    #: One row the broker may refuse, produced alone (see Relay._extent).
    isolated: bool = False
    #: When its reports are overdue (monotonic): the shard replays (delivery_timeout_ms).
    deadline: float = math.inf
    parked: list[Parking] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)

    @property
    def acknowledged(self) -> bool:
        return self.outstanding == 0 and self.failure is None

    @property
    def has_writes(self) -> bool:
        return bool(self.rows or self.parked or self.held)

    def report(self, error: KafkaError | None, message: Message | None) -> None:
        """The delivery report of each of the page's records (called from a producer poll)."""
        if self.outstanding <= 0:
            return  # the page was abandoned (its shard replays or was lost)
        self.outstanding -= 1
        self.in_flight.count -= 1
        if error is not None:
            self.errors.append((error, message))

    def abandon(self) -> None:
        """Stop counting the page's reports (its shard replays, or was lost)."""
        self.in_flight.count -= self.outstanding
        self.outstanding = 0


@dataclass(eq=False)
class _Shard:
    shard: int
    epoch: int
    recorded: Progress
    cursor: Progress
    lease_deadline: float
    pages: deque[_Page] = field(default_factory=deque)
    attempts: int = 0
    retry_at: float = 0.0
    handing_off: bool = False
    #: Rows asked for by the next read; doubles while reads come back full (see _read).
    page_size: int = 0


class Relay:
    """One relay process's loop; ``run(stop)`` returns after a graceful drain."""

    def __init__(
        self,
        *,
        store: RelayStore,
        publisher_factory: Callable[[], Publisher],
        settings: RelaySettings,
        metrics: RelayMetrics,
        wakeup: Wakeup | None = None,
        housekeeping: Housekeeping | None = None,
    ) -> None:
        """``housekeeping`` runs the purge timer off the loop; the default one has no Kafka
        settings, so on partitioned tables its retention runs fail for want of Kafka's answer
        (:func:`~oncely.relay.service.build_relay` gives the relay's)."""
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._wakeup = wakeup
        self._backoff = Backoff(
            first=settings.initial_backoff_seconds, maximum=settings.max_backoff_seconds, jitter=0.5
        )
        self._publisher = publisher_factory()
        self.housekeeping = housekeeping or Housekeeping(
            store=store,
            settings=settings,
            retention_settings=RetentionSettings(),
            kafka={},
            metrics=metrics.retention,
        )
        self._shards: dict[int, _Shard] = {}
        self._parked: dict[tuple[str, str], Parking] = {}
        self._attempts: dict[UUID, int] = {}
        self._suspects: set[UUID] = set()
        self._confirmed: dict[tuple[str, int], int] = {}
        self._latencies: list[float] = []
        self._topics = TopicWatch(
            probe=self._publisher.topic_state,
            backoff=Backoff(
                first=settings.initial_backoff_seconds,
                maximum=min(settings.max_backoff_seconds, _TOPIC_CHECK_MAX),
                jitter=0.5,
            ),
        )
        self._blocked_gauged: set[str] = set()
        #: Shards with parked keys due for release (not read until released): _release_parked.
        self._releasing: frozenset[int] = frozenset()
        self._in_flight = _InFlight()
        #: Progress of acknowledged pages, by shard, waiting for the next record.
        self._unrecorded: dict[int, ShardProgress] = {}
        self._record_after = 0.0
        self._quiet_record = Every(_QUIET_RECORD_INTERVAL)
        #: Rows read since the backlog gauges were last updated, and whether they showed any.
        self._rows_since_gauges = 0
        self._backlog_seen = True
        self._pace = Pace(
            listen_below=_LISTEN_BELOW,
            poll_above=_POLL_ABOVE,
            fallback=settings.poll_interval_seconds,
            window_start=time.monotonic(),
        )
        #: A quiet relay sends a read's records at once (linger.ms not configured).
        self._send_at_once = settings.linger_ms is None
        self.heartbeat = time.monotonic()
        self.database_ok = True

    # -- health --------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """The loop turned recently (it is not stuck)."""
        return time.monotonic() - self.heartbeat < max(30.0, self.settings.lease_seconds)

    def ready(self) -> bool:
        """The last database call worked and the broker is reachable."""
        return self.healthy() and self.database_ok and not self._publisher.brokers_down

    @property
    def shards(self) -> frozenset[int]:
        """The shards this relay holds now."""
        return frozenset(self._shards)

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set, then drain; never raises for broker or database faults.

        Raises :class:`KafkaAuthenticationError` (after giving back its shards) when the broker
        refuses the credentials.
        """
        tick = Every(self.settings.lease_seconds / 3)
        gauges = Every(_GAUGE_INTERVAL)
        purge = Every(self.settings.purge_interval_seconds)
        pace = self._pace
        while not stop.is_set():
            self.heartbeat = now = time.monotonic()
            if self._publisher.auth_failed is not None:
                break
            if tick.due():
                self._tick()
            if gauges.due():
                self._update_gauges()
            if purge.due():
                self.housekeeping.due()
            self._publisher.poll(0)
            self._settle()
            self._release_parked()
            if pace.mode is Mode.LISTENING and self._wakeup is not None and self._wakeup.pending():
                pace.ask()
            read, complete = 0, True
            if pace.guard is not None:
                self._check_guard()
            if pace.should_read(now):
                read, complete = self._read()
                pace.read_done(read, complete=complete, now=time.monotonic())
                self._rows_since_gauges += read
            self._pace_switch()
            if read and pace.mode is Mode.LISTENING and self._send_at_once:
                # Quiet: no other rows will join these records, so they go out now (flush
                # ignores linger.ms) and their reports are served, rather than after linger.
                self._publisher.flush(_SEND_WAIT)
                self._settle()
            if read and (pace.mode is Mode.POLLING or not complete):
                continue
            if not pace.listens() or self._wakeup is None:
                self._publisher.poll(pace.poll)
            elif self._in_flight.count:
                # Delivery reports only move progress (recorded every 20 ms): serve them
                # between waits, and wake at once for a commit.
                if self._wakeup.wait(_REPORTS_WAIT):
                    pace.ask()
            elif self._wakeup.wait(self._quiet_wait(tick)):
                pace.ask()
        self._drain()
        if self._publisher.auth_failed is not None:
            raise KafkaAuthenticationError.of(self._publisher.auth_failed)

    def _quiet_wait(self, tick: Every) -> float:
        """How long a quiet relay with nothing in flight waits for a NOTIFY: until its fallback
        read, its tick, or the recording of progress acknowledged since the last record."""
        now = time.monotonic()
        wait = min(self._pace.fallback - (now - self._pace.last_read), tick.remaining())
        if self._unrecorded:
            wait = min(wait, self._record_after - now)
        return max(0.0, wait)

    def _pace_switch(self) -> None:
        """Switch between polling and listening when the rate of rows read asks for it."""
        mode = self._pace.switch(time.monotonic())
        if mode is None or (mode is Mode.LISTENING and self._wakeup is None):
            return
        listening = mode is Mode.LISTENING
        try:
            if self._wakeup is not None:
                if listening:
                    self._wakeup.listen()
                else:
                    self._wakeup.unlisten()
            self.store.sleep(asleep=listening)
            guard = self.store.snapshot()[0].xmax if listening else None
        except (sa.exc.DBAPIError, psycopg.Error) as exc:
            self.database_ok = False
            log.warning("database: switching to %s failed, retrying: %s", mode.value, exc)
            return
        self._pace.switched(mode, guard=guard)
        log.debug("relay %s", mode.value)

    def _check_guard(self) -> None:
        """Listening since a moment ago: have the transactions running then ended?"""
        try:
            snapshot, _ = self.store.snapshot()
        except sa.exc.DBAPIError as exc:
            self._database_failed("snapshot", exc)
            return
        self._pace.guard_passed(snapshot.xmin)

    # -- membership and leases -----------------------------------------------------------------

    def _tick(self) -> None:
        """Heartbeat, renew, take or hand off shards to the fair share; record quiet shards."""
        lease = self.settings.lease_seconds
        try:
            started = time.monotonic()
            membership = self.store.heartbeat(
                ttl_seconds=lease,
                asleep=self._pace.mode is Mode.LISTENING,
                leases=[(s.shard, s.epoch) for s in self._shards.values()],
            )
        except sa.exc.DBAPIError as exc:
            self._database_failed("lease renewal", exc)
            return
        self.database_ok = True
        for shard in [s for s in self._shards.values() if s.shard not in membership.kept]:
            log.warning("lost shard %d to another relay", shard.shard)
            self.metrics.lease_lost.inc()
            self._forget(shard)
        for shard in self._shards.values():
            shard.lease_deadline = started + lease
        plan = rebalance(
            (s.shard for s in self._shards.values() if not s.handing_off),
            shards=membership.shards,
            alive=membership.alive,
        )
        for number in plan.hand_off:
            self._shards[number].handing_off = True
        if plan.take:
            self._acquire(plan.take, started)
        if self._quiet_record.due():
            self._record_quiet()
        self._refresh_parked()
        self.metrics.shards.set(len(self._shards))

    def _acquire(self, wanted: int, started: float) -> None:
        try:
            leases = self.store.acquire(wanted=wanted, lease_seconds=self.settings.lease_seconds)
            if leases:
                parked = self.store.parked([lease.shard for lease in leases])
        except sa.exc.DBAPIError as exc:
            self._database_failed("lease", exc)
            return
        for lease in leases:
            self._shards[lease.shard] = _Shard(
                lease.shard,
                lease.epoch,
                lease.progress,
                lease.progress,
                started + self.settings.lease_seconds,
            )
            self.metrics.lease_epoch.labels(str(lease.shard)).set(lease.epoch)
        if leases:
            self._parked.update({p.key: p for p in parked})
            self._pace.ask()
            self._backlog_seen = True
            log.info("took shards %s", sorted(lease.shard for lease in leases))

    def _forget(self, shard: _Shard) -> None:
        """Drop a shard without recording anything (it was lost, or has been given back)."""
        self._shards.pop(shard.shard, None)
        self._unrecorded.pop(shard.shard, None)
        for page in shard.pages:
            page.abandon()
        shard.pages.clear()
        for key in [k for k, p in self._parked.items() if p.shard == shard.shard]:
            del self._parked[key]
        for gauge in (self.metrics.lease_epoch, self.metrics.held_keys):
            with contextlib.suppress(KeyError):
                gauge.remove(str(shard.shard))

    def _hand_off(self) -> None:
        """Give back shards over the fair share once everything read from them is recorded."""
        ready = [s for s in self._shards.values() if s.handing_off and not s.pages]
        if not ready:
            return
        self._record_quiet(ready)
        try:
            released = self.store.release([(s.shard, s.epoch) for s in ready])
        except sa.exc.DBAPIError as exc:
            self._database_failed("hand-off", exc)
            return
        for shard in ready:
            self._forget(shard)
        if released:
            log.info("handed off shards %s", sorted(released))

    def _refresh_parked(self) -> None:
        """Read the parked keys of the shards held again; keys parked by pages still in flight
        (not recorded yet) stay parked. Nothing to read when none are: only this relay parks
        keys of the shards it holds, and it read their parked keys when it took them."""
        if not self._shards:
            return
        if not self._parked:
            for shard in self._shards:
                self.metrics.held_keys.labels(str(shard)).set(0)
            return
        try:
            parked = self.store.parked(list(self._shards))
        except sa.exc.DBAPIError as exc:
            self._database_failed("parked keys", exc)
            return
        pending = {p.key: p for s in self._shards.values() for page in s.pages for p in page.parked}
        self._parked = {**pending, **{p.key: p for p in parked}}
        for shard in self._shards:
            self.metrics.held_keys.labels(str(shard)).set(
                sum(1 for p in parked if p.shard == shard)
            )

    # -- reading and producing -----------------------------------------------------------------

    def _readable(self, now: float) -> list[_Shard]:
        margin = self.settings.lease_seconds / 3
        releasing = self._releasing
        return [
            s
            for s in self._shards.values()
            if not s.handing_off
            and s.retry_at <= now
            and now < s.lease_deadline - margin
            and s.shard not in releasing
            and not (s.pages and s.pages[-1].isolated)
        ]

    def _due(self) -> dict[int, list[Parking]]:
        """The parked keys to release now, by shard: an operator asked, their delay passed, or
        their blocked topic exists (asked of the broker with backoff, once per topic)."""
        due: dict[int, list[Parking]] = {}
        blocked: dict[str, bool] = {}
        for parking in self._parked.values():
            if parking.request is None and not parking.due:
                if parking.reason != "blocked":
                    continue
                topic = parking.topic
                if topic not in blocked:
                    blocked[topic] = self._topics.is_blocked(topic)
                if blocked[topic]:
                    continue
            due.setdefault(parking.shard, []).append(parking)
        return due

    def _read(self) -> tuple[int, bool]:
        """Read one page per group of shards at the same position; return the rows read and
        whether the reads reached the end of what was committed (every shard held was read,
        none had more left: nothing is left to read until the next commit)."""
        room = self.settings.max_in_flight - self._in_flight.count
        if room <= 0:
            return 0, False
        fresh: Snapshot | None = None
        total = 0
        groups = self._groups()
        complete = sum(len(members) for members in groups.values()) == sum(
            1 for s in self._shards.values() if not s.handing_off
        )
        for cursor, members in groups.items():
            if cursor.reading is None and fresh is None:
                try:
                    fresh, _ = self.store.snapshot()
                except sa.exc.DBAPIError as exc:
                    self._database_failed("snapshot", exc)
                    return total, False
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

    def _groups(self) -> dict[Progress, list[_Shard]]:
        """The readable shards grouped by position (each group is read by one statement)."""
        groups: dict[Progress, list[_Shard]] = {}
        for shard in self._readable(time.monotonic()):
            groups.setdefault(shard.cursor, []).append(shard)
        return groups

    def _read_page(
        self, cursor: Progress, members: list[_Shard], reading: Snapshot, room: int
    ) -> tuple[int, bool] | None:
        """Read ``members`` from ``cursor`` and produce what was read, a page per shard; return
        how many rows and whether ``reading`` is read to its end, or ``None`` to read nothing
        more this turn (the database failed)."""
        # Each page of a read scans what is left of the snapshot difference: while pages
        # come back full (a large backlog), ask for twice as many, up to half the
        # in-flight bound, so a backlog costs a few scans rather than one per 1,000 rows.
        grown = min(s.page_size or self.settings.batch_size for s in members)
        page_size = min(room, grown)
        try:
            rows = self.store.read(
                [s.shard for s in members],
                done=cursor.done,
                reading=reading,
                after_seq=cursor.after_seq,
                page_size=page_size,
            )
        except sa.exc.DBAPIError as exc:
            self._database_failed("read", exc)
            return None
        self.database_ok = True
        blocked = self._blocked_topics(rows)
        extent = self._extent(cursor, reading, rows, page_size, members, blocked)
        if extent is None:
            return 0, False
        rows, ends, isolated = extent
        cap = max(self.settings.batch_size, self.settings.max_in_flight // 2)
        for shard in members:
            shard.page_size = min(cap, grown * 2) if len(rows) == page_size else 0
        if rows:
            failpoint("relay.after_read")
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000
        pages: dict[int, _Page] = {}
        if rows:
            for row in rows:
                if row.shard not in pages:
                    pages[row.shard] = _Page(
                        row.shard, ends, self._in_flight, isolated=isolated, deadline=deadline
                    )
            self._produce_pages(pages, rows, blocked)
        for shard in members:
            shard.cursor = ends
            page = pages.get(shard.shard)
            if page is not None and page.has_writes:
                shard.pages.append(page)
            elif shard.pages:  # its progress is recorded after the pages in flight
                shard.pages.append(_Page(shard.shard, ends, self._in_flight))
        return len(rows), ends.reading is None

    def _blocked_topics(self, rows: list[OutboxRow]) -> frozenset[str]:
        """The topics of ``rows`` that are blocked (missing or not authorised)."""
        if not rows:
            return frozenset()
        is_blocked = self._topics.is_blocked
        return frozenset(t for t in {row.topic for row in rows} if is_blocked(t))

    def _extent(
        self,
        cursor: Progress,
        reading: Snapshot,
        rows: list[OutboxRow],
        page_size: int,
        members: list[_Shard],
        blocked: frozenset[str],
    ) -> tuple[list[OutboxRow], Progress, bool] | None:
        """The rows to produce, where the read ends and whether it is one isolated row
        (:mod:`oncely.relay.extent`); ``None`` when the group waits. A row going out alone
        leaves ``members`` to its shard, the others moved past it."""
        parked = self._parked
        suspect = first_suspect(
            rows,
            waiting=lambda row: (
                row.delayed or (bool(parked) and row.parking_key in parked) or row.topic in blocked
            ),
            suspects=self._suspects,
            limit_of=self._publisher.max_message_bytes,
        )
        shards = {s.shard: s for s in members}
        ends = extent(
            rows,
            cursor=cursor,
            reading=reading,
            page_size=page_size,
            suspect=suspect,
            busy=lambda shard: bool(shards[shard].pages),
        )
        if ends is None:
            return None
        if ends.alone is not None:
            for shard in members:
                if shard.shard != ends.alone:
                    shard.cursor = ends.ends
            members[:] = [shards[ends.alone]]
        return list(ends.rows), ends.ends, ends.alone is not None

    def _produce_pages(
        self, pages: dict[int, _Page], rows: list[OutboxRow], blocked: frozenset[str]
    ) -> None:
        """Produce ``rows`` (parking or holding those that must wait), each on its shard's page.

        A row the client refuses at once fails its shard's page: the shard's later rows are not
        produced (it replays); the other shards' rows are.
        """
        parked = self._parked
        for index, row in enumerate(rows):
            page = pages[row.shard]
            if page.failure is not None:
                continue
            parking = parked.get(row.parking_key) if parked else None
            if parking is not None:
                if parking.event_id != row.id:
                    page.held.append(Held(row.id, row.topic, row.aggregateid, row.shard))
                continue
            if row.delayed or (blocked and row.topic in blocked):
                parking = self._parking_of(row)
                self._parked[parking.key] = parking
                page.parked.append(parking)
                continue
            page.rows += 1
            refused = self._publisher.produce(row, page.report)
            if refused is not None:
                self._count_error(row, refused)
                page.failure = _Failure(row, refused, own=True)
                continue
            page.outstanding += 1
            self._in_flight.count += 1
            page.produced.append(row)
            if index == len(rows) // 2:
                failpoint("relay.mid_page")
        if rows:
            failpoint("relay.after_produce_before_ack")

    def _parking_of(self, row: OutboxRow) -> Parking:
        """The parking of a row that cannot go out now: delayed, or its topic blocked."""
        if row.delayed:
            return Parking(
                row.topic, row.aggregateid, row.shard, row.id, "delayed", until=row.available_at
            )
        state = (
            "not authorised" if self._topics.state(row.topic) is TopicState.DENIED else "missing"
        )
        return Parking(
            row.topic,
            row.aggregateid,
            row.shard,
            row.id,
            "blocked",
            error=f"topic {row.topic} is {state}",
        )

    def _take_errors(self) -> None:
        """Look at the failed reports of every page: metrics, blocked topics, and each page's
        first failure."""
        for shard in self._shards.values():
            for page in shard.pages:
                if not page.errors:
                    continue
                by_id = {row.event_id.encode(): row for row in page.produced}
                for error, message in page.errors:
                    headers = dict(message.headers() or []) if message is not None else {}
                    event_id = headers.get("id")
                    row = (by_id.get(event_id) if isinstance(event_id, bytes) else None) or (
                        page.produced[-1]
                    )
                    self._count_error(row, error)
                    state = topic_error_state(error)
                    if state is not None:
                        self._topics.block(row.topic, state)
                    if page.failure is None:
                        page.failure = _Failure(row, error, own=page.isolated)
                page.errors.clear()

    def _count_error(self, row: OutboxRow, error: KafkaError) -> None:
        self.metrics.produce_errors.labels(row.topic, error.name()).inc()
        self.metrics.shard_produce_errors.labels(str(row.shard)).inc()

    def _count_published(self, page: _Page) -> None:
        """Count an acknowledged page's rows as published, per topic, and its latency (from
        its oldest row's commit) once."""
        produced = page.produced
        if not produced:
            return
        self._publisher.reachable()
        confirmed = self._confirmed
        for topic, count in Counter(row.topic for row in produced).items():
            key = (topic, page.shard)
            confirmed[key] = confirmed.get(key, 0) + count
        self._latencies.append(time.time() - min(row.timestamp_ms for row in produced) / 1000)
        if self._suspects:
            self._suspects.difference_update(row.id for row in produced)
        page.produced = []

    # -- progress ------------------------------------------------------------------------------

    def _count_confirmed(self) -> None:
        """Move the confirmations counted in the delivery reports into the metrics."""
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

    def _settle(self) -> None:
        """Record acknowledged pages; replay the shards whose delivery failed or is overdue."""
        self._take_errors()
        if self._publisher.fatal is not None:
            log.warning("fatal producer error, recreating the producer and replaying")
            self._recreate("fatal")
            return
        parked: dict[tuple[str, str], tuple[Parking, int]] = {}
        held: list[Held] = []
        failed: dict[int, _Failure | None] = {}
        overdue: list[_Page] = []
        now = time.monotonic()
        for shard in self._shards.values():
            pages = shard.pages
            last: _Page | None = None
            while pages and pages[0].acknowledged:
                last = pages.popleft()
                self._count_published(last)
                parked.update({p.key: (p, shard.epoch) for p in last.parked})
                held.extend(last.held)
            if last is not None:
                self._unrecorded[shard.shard] = ShardProgress(shard.shard, shard.epoch, last.ends)
            if pages:
                first = pages[0]
                if first.failure is not None:
                    failed[shard.shard] = first.failure
                elif first.outstanding and now >= first.deadline:
                    overdue.append(first)
        if overdue:
            failed.update(self._overdue(overdue, now))
        self._count_confirmed()
        if self._unrecorded and (parked or held or time.monotonic() >= self._record_after):
            self._record_acknowledged(list(parked.values()), held)
        if failed:
            self._replay(failed)
        self._hand_off()

    def _record_acknowledged(
        self, parked: list[tuple[Parking, int]] | None = None, held: list[Held] | None = None
    ) -> None:
        """Record the progress of the acknowledged pages not yet recorded (at most every
        _RECORD_INTERVAL, at once with parked keys or held rows)."""
        failpoint("relay.after_ack_before_record")
        progress = list(self._unrecorded.values())
        self._unrecorded.clear()
        self._record(progress, parked or [], held or [])
        self._record_after = time.monotonic() + _RECORD_INTERVAL

    def _epoch_of(self, shard: int) -> int:
        return self._shards[shard].epoch if shard in self._shards else -1

    def _record(
        self,
        progress: list[ShardProgress],
        parked: list[tuple[Parking, int]],
        held: list[Held],
    ) -> None:
        try:
            recorded = self.store.record(progress, parked=parked, held=held)
            refused = {p.shard for p in progress} - recorded
            if refused:
                self.metrics.progress_refused.inc(len(refused))
                log.warning("progress refused for shards %s: taken over", sorted(refused))
                for shard in refused:
                    if shard in self._shards:
                        self.metrics.lease_lost.inc()  # found here before the next heartbeat
                        self._forget(self._shards[shard])
                progress = [p for p in progress if p.shard not in refused]
                parked = [(p, e) for p, e in parked if p.shard not in refused]
                held = [h for h in held if h.shard not in refused]
                self.store.record(progress, parked=parked, held=held)
        except sa.exc.DBAPIError as exc:
            self._database_failed("progress", exc)
            self._reset(list(self._shards.values()), backoff=True)
            return
        self.database_ok = True
        for item in progress:
            self._unrecorded.pop(item.shard, None)
            held_shard = self._shards.get(item.shard)
            if held_shard is not None:
                held_shard.recorded = item.progress
                held_shard.attempts = 0

    def _record_quiet(self, shards: Iterable[_Shard] | None = None) -> None:
        """Record the position of shards whose last reads found nothing to publish."""
        quiet = [
            s
            for s in (shards if shards is not None else self._shards.values())
            if not s.pages and s.cursor != s.recorded
        ]
        if quiet:
            self._record([ShardProgress(s.shard, s.epoch, s.cursor) for s in quiet], [], [])

    def _replay(self, failed: dict[int, _Failure | None]) -> None:
        """Replay the failed shards from their recorded progress; no other shard is touched.

        ``None``: the shard's oldest page is overdue (:meth:`_overdue`). With every broker down
        past that, the producer cannot go on: it is recreated and every shard replays. A topic
        missing or not authorised blocks the topic (its rows are parked on the replay, at once).
        A permanent error counts against the row only when it was its own; otherwise the row is
        retried alone first.
        """
        if any(failure is None for failure in failed.values()) and self._publisher.brokers_down:
            log.warning(
                "delivery timed out after %d ms with every broker down, recreating the producer",
                self.settings.delivery_timeout_ms,
            )
            self._recreate("brokers_down")
            return
        backoff: dict[int, bool] = {}
        for shard, failure in failed.items():
            backoff[shard] = self._judge(shard, failure)
        if self._unrecorded:
            self._record_acknowledged()  # replay only what was not acknowledged
        for number, delayed in backoff.items():
            held = self._shards.get(number)
            if held is not None:
                self._reset([held], backoff=delayed)

    def _judge(self, shard: int, failure: _Failure | None) -> bool:
        """Count and log a shard's failure; whether its replay waits (backoff)."""
        if failure is None:
            log.warning(
                "delivery timed out after %d ms, replaying shard %d from its recorded progress",
                self.settings.delivery_timeout_ms,
                shard,
                extra={"shard": shard, "code": "_MSG_TIMED_OUT"},
            )
            return True
        row, error = failure.row, failure.error
        if topic_error_state(error) is not None:
            return False  # the topic is blocked now: the replay parks its rows
        transient = delivery.is_transient(error)
        log.warning(
            "delivery failed, replaying shard %d from its recorded progress: %s",
            shard,
            error.str(),
            extra={"id": str(row.id), "topic": row.topic, "shard": shard, "code": error.name()},
        )
        if transient:
            return True
        self._publisher.forget_limits(row.topic)
        if not failure.own:
            self._suspects.add(row.id)
            return False
        attempts = self._attempts[row.id] = self._attempts.get(row.id, 0) + 1
        if delivery.goes_dead(error, attempts, max_attempts=self.settings.max_attempts):
            self._dead_letter(row, delivery.error_text(error))
        return True

    def _overdue(self, pages: list[_Page], now: float) -> dict[int, None]:
        """The shards whose oldest page is unconfirmed past ``delivery_timeout_ms`` and must
        replay (``None``: no failure report). With every broker down, all of them (the producer
        is then recreated). Otherwise their topics are asked about again: a shard whose records
        went to a topic gone since (deleted, access revoked) replays, and its rows are parked.
        The others wait on: librdkafka keeps retrying their records, in order, until the broker
        takes them (a partition without a leader or in-sync replicas), and a replay would only
        queue copies behind them."""
        for page in pages:
            topic = page.produced[0].topic if page.produced else ""
            self.metrics.produce_errors.labels(topic, "_MSG_TIMED_OUT").inc()
            self.metrics.shard_produce_errors.labels(str(page.shard)).inc()
        if self._publisher.brokers_down:
            return {page.shard: None for page in pages}
        topics = {row.topic for page in pages for row in page.produced}
        self._topics.forget(topics)
        gone = {topic for topic in topics if self._topics.is_blocked(topic)}
        replay: dict[int, None] = {}
        waiting = 0
        for page in pages:
            if gone and any(row.topic in gone for row in page.produced):
                replay[page.shard] = None
            else:
                page.deadline = now + self.settings.delivery_timeout_ms / 1000
                waiting += 1
        if waiting:
            log.warning(
                "%d shard(s) have records the broker has not confirmed after %d ms (a partition "
                "without a leader or in-sync replicas?): waiting for them, in order",
                waiting,
                self.settings.delivery_timeout_ms,
                extra={"code": "_MSG_TIMED_OUT"},
            )
        return replay

    def _recreate(self, reason: str) -> None:
        """The producer cannot go on: record what is acknowledged, start a new producer (every
        outstanding record fails) and replay every shard from its recorded progress."""
        self.metrics.producer_recreations.labels(reason).inc()
        if self._unrecorded:
            self._record_acknowledged()
        self._publisher.recreate()
        self._reset(list(self._shards.values()), backoff=True)

    def _reset(self, shards: list[_Shard], *, backoff: bool) -> None:
        """Drop what ``shards`` have in flight and read them again from their recorded progress
        (after a backoff); keys their dropped pages parked are not parked any more."""
        self._pace.ask()
        now = time.monotonic()
        parked = self._parked
        for shard in shards:
            self.metrics.shard_replays.labels(str(shard.shard)).inc()
            self._unrecorded.pop(shard.shard, None)
            for page in shard.pages:
                page.abandon()
                for parking in page.parked:
                    if parked.get(parking.key) is parking:
                        del parked[parking.key]
            shard.pages.clear()
            shard.cursor = shard.recorded
            if backoff:
                shard.attempts += 1
                shard.retry_at = now + self._backoff.delay(shard.attempts)

    def _dead_letter(self, row: OutboxRow, error: str) -> None:
        parking = Parking(row.topic, row.aggregateid, row.shard, row.id, "dead", error=error)
        try:
            self.store.park([(parking, self._epoch_of(row.shard))])
        except sa.exc.DBAPIError as exc:
            self._database_failed("dead letter", exc)
            return
        self._parked[parking.key] = parking
        self._attempts.pop(row.id, None)
        self._suspects.discard(row.id)
        self.metrics.dead.labels(row.topic).inc()
        log.error(
            "row dead-lettered, its key is parked: %s",
            error,
            extra={"id": str(row.id), "topic": row.topic, "key": row.aggregateid},
        )

    # -- parked keys ---------------------------------------------------------------------------

    def _release_parked(self) -> None:
        """Publish the rows of keys an operator released, whose delay passed or whose topic
        exists again, in order: the due keys of a shard together, once it has nothing in
        flight."""
        if not self._parked:
            self._releasing = frozenset()
            return
        now = time.monotonic()
        due = self._due()
        self._releasing = frozenset(due)
        for number, parkings in due.items():
            shard = self._shards.get(number)
            if shard is None or shard.pages or shard.retry_at > now:
                continue  # wait until everything read from the shard is acknowledged
            if shard.shard in self._unrecorded:
                self._record_acknowledged()  # and recorded: release on the next turn
                continue
            self._release(shard, parkings)

    def _release(self, shard: _Shard, parkings: list[Parking]) -> None:
        """Publish parked keys' rows (each key's dead, delayed or blocked row first, unless
        skipped), then unpark each key whose rows all went out. A key whose rows failed stays
        parked: blocked again if its topic is missing, dead if its own row failed for good;
        the shard then waits (backoff) before the next try."""
        batch: list[tuple[Parking, list[tuple[int, UUID]], list[OutboxRow]]] = []
        try:
            for parking in parkings:
                held = self.store.held_of(parking.key)
                ids = [event_id for _, event_id in held]
                if parking.request != "skip":
                    ids.insert(0, parking.event_id)
                found = self.store.rows(ids)
                batch.append((parking, held, [found[i] for i in ids if i in found]))
        except sa.exc.DBAPIError as exc:
            self._database_failed("release", exc)
            return
        results, complete = self._publish_alone([row for _, _, rows in batch for row in rows])
        errors = {row.id: error for row, error in results if error is not None}
        acked = {row.id for row, error in results if error is None}
        failed = not complete or bool(errors)
        for parking, held, rows in batch:
            if any(row.id not in acked for row in rows):
                self._park_again(parking, [(row, errors.get(row.id)) for row in rows])
                continue
            for row in rows:
                self.metrics.published.labels(row.topic).inc()
                self.metrics.shard_published.labels(str(row.shard)).inc()
            try:
                released = self.store.unpark(
                    parking, epoch=shard.epoch, published_to=held[-1][0] if held else None
                )
            except sa.exc.DBAPIError as exc:
                self._database_failed("release", exc)
                return
            if released:
                self._parked.pop(parking.key, None)
                log.info(
                    "key released (%s): %d row(s) published",
                    parking.request or parking.reason,
                    len(rows),
                    extra={"topic": parking.topic, "key": parking.aggregateid},
                )
        if failed:
            self._reset([shard], backoff=True)

    def _publish_alone(
        self, rows: list[OutboxRow]
    ) -> tuple[list[tuple[OutboxRow, KafkaError | None]], bool]:
        """Produce ``rows`` and wait for their reports; return them, and whether all came."""
        results: list[tuple[OutboxRow, KafkaError | None]] = []
        for row in rows:
            refused = self._publisher.produce(row, self._collect(row, results))
            if refused is not None:
                results.append((row, refused))
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000 + 5
        while len(results) < len(rows) and time.monotonic() < deadline:
            self._publisher.poll(0.05)
        return results, len(results) == len(rows)

    def _park_again(
        self, parking: Parking, results: list[tuple[OutboxRow, KafkaError | None]]
    ) -> None:
        """A released key's rows did not all go out: it stays parked. Its topic missing blocks
        the topic (the key stays blocked); a permanent failure of its own row makes it dead."""
        failures = [(row, error) for row, error in results if error is not None]
        if not failures:
            return
        row, error = failures[0]
        assert error is not None
        state = topic_error_state(error)
        if state is not None:
            self._topics.block(row.topic, state)
            if parking.reason == "blocked":
                return
        if row.id != parking.event_id or delivery.is_transient(error):
            return
        text = delivery.error_text(error)
        try:
            self.store.park_failed(parking, error=text)
        except sa.exc.DBAPIError as exc:
            self._database_failed("dead letter", exc)
            return
        self._parked[parking.key] = dataclasses.replace(
            parking, reason="dead", error=text, until=None, request=None, due=False
        )

    @staticmethod
    def _collect(
        row: OutboxRow, results: list[tuple[OutboxRow, KafkaError | None]]
    ) -> Callable[[KafkaError | None, Message | None], None]:
        def report(error: KafkaError | None, message: Message | None) -> None:
            results.append((row, error))

        return report

    # -- gauges, purge, failures, stop ---------------------------------------------------------

    def _update_gauges(self) -> None:
        if self._shards and (self._rows_since_gauges or self._backlog_seen):
            self._update_backlog()
        self._update_blocked()

    def _update_backlog(self) -> None:
        """Backlog gauges of the shards held (not asked again while nothing is read and the
        last answer was empty)."""
        try:
            backlog = self.store.backlog()
        except sa.exc.DBAPIError as exc:
            self._database_failed("backlog", exc)
            return
        self._rows_since_gauges = 0
        self._backlog_seen = bool(backlog)
        rows: dict[int, int] = {}
        lag: dict[int, float] = {}
        for item in backlog:
            rows[item.shard] = rows.get(item.shard, 0) + item.unpublished
            lag[item.shard] = max(lag.get(item.shard, 0.0), item.oldest_unpublished_seconds)
        for shard in self._shards:
            self.metrics.unpublished.labels(str(shard)).set(rows.get(shard, 0))
            self.metrics.lag.labels(str(shard)).set(lag.get(shard, 0.0))

    def _update_blocked(self) -> None:
        """Rows held per blocked topic (read only while this relay knows of blocked keys)."""
        if not self._blocked_gauged and not any(
            p.reason == "blocked" for p in self._parked.values()
        ):
            return
        try:
            blocked = self.store.blocked_rows()
        except sa.exc.DBAPIError as exc:
            self._database_failed("blocked topics", exc)
            return
        for topic in self._blocked_gauged - blocked.keys():
            with contextlib.suppress(KeyError):
                self.metrics.blocked_rows.remove(topic)
        for topic, count in blocked.items():
            self.metrics.blocked_rows.labels(topic).set(count)
        self._blocked_gauged = set(blocked)

    def _database_failed(self, what: str, exc: sa.exc.DBAPIError) -> None:
        self.database_ok = False
        log.warning("database %s failed, retrying: %s", what, exc.orig)
        time.sleep(min(1.0, self.settings.poll_interval_seconds))

    def _drain(self) -> None:
        """Stop reading, wait (bounded) for reports, record, give every shard back."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_seconds
        for shard in self._shards.values():
            shard.handing_off = True
        while (
            self._shards
            and self._publisher.auth_failed is None
            and self._publisher.fatal is None
            and time.monotonic() < deadline
        ):
            self._publisher.flush(min(0.5, max(0.0, deadline - time.monotonic())))
            before = len(self._shards)
            self._settle()
            if len(self._shards) == before and any(s.pages for s in self._shards.values()):
                continue
            if all(not s.pages for s in self._shards.values()):
                self._hand_off()
        unanswered = len(self._shards)
        self.housekeeping.join(max(0.0, deadline - time.monotonic()))
        try:
            self.store.release([(s.shard, s.epoch) for s in self._shards.values()])
            self.store.leave()
        except sa.exc.DBAPIError as exc:
            log.warning("could not give back %d shards: %s", unanswered, exc.orig)
        self._count_confirmed()
        self.store.close()
        if self._wakeup is not None:
            self._wakeup.close()
        log.info("relay stopped", extra={"unrecorded_shards": unanswered})
