"""Fakes of what the relay's loop holds (:mod:`oncely.relay.ports`), for unit tests that run the
loop with no database and no broker: an in-memory outbox with snapshots, leases fenced by
epoch and parked keys; a producer whose reports come from ``poll``; and a clock that only moves
when the loop waits. They model the contracts the loop relies on, not PostgreSQL or Kafka (the
integration tests run the same loop against both)."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry

from oncely.relay.ports import FAILED, Failed, OnDelivery
from oncely.relay.relay import Relay
from oncely.relay.signals import Signals
from oncely.relay.topics import TopicState
from oncely.relay.transactions import Ended
from oncely.runtime.metrics import RelayMetrics
from oncely.settings import RelaySettings
from oncely.storage.stores.outbox.relay import (
    Heartbeat,
    Held,
    Parking,
    Progress,
    ShardBacklog,
    ShardProgress,
)
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

T = TypeVar("T")


class Clock:
    """Monotonic seconds that move only when told (the fake producer's waits move it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def database_error(what: str = "connection lost") -> sa.exc.DBAPIError:
    return sa.exc.OperationalError(what, {}, Exception(what))


@dataclass
class _Lease:
    epoch: int = 0
    owner: str | None = None
    progress: Progress = field(default_factory=lambda: Progress(Snapshot(1, 1, frozenset())))


class FakeStore:
    """An outbox of ``shards`` shards: rows commit with increasing transaction ids, snapshots
    see every committed one; leases, progress and parked keys as the relay's statements keep
    them. ``fail`` makes the named statements raise a database error (each call pops one)."""

    def __init__(self, *, shards: int = 4, owner: str = "relay-1", alive: int = 1) -> None:
        self.owner = owner
        self.alive = alive
        self.next_txid = 1
        self.seq = 0
        self.outbox: list[tuple[int, OutboxRow]] = []
        self.leases = {n: _Lease() for n in range(shards)}
        self.parkings: dict[tuple[str, str], Parking] = {}
        self.held: dict[tuple[str, str], list[tuple[int, UUID]]] = {}
        self.positions = 0
        self.fail: dict[str, int] = {}
        self.records: list[list[ShardProgress]] = []
        self.asleep = False
        self.backlog_reads = 0

    def _maybe_fail(self, statement: str) -> None:
        if self.fail.get(statement, 0) > 0:
            self.fail[statement] -= 1
            raise database_error(statement)

    # -- what a test does ----------------------------------------------------------------------

    def stage(
        self, shard: int, key: str, *, topic: str = "orders", available_at: datetime | None = None
    ) -> OutboxRow:
        """Commit one row (its own transaction)."""
        self.seq += 1
        row = OutboxRow(
            str(uuid.uuid4()),
            self.seq,
            shard,
            topic,
            key,
            "OrderPlaced",
            b"{}",
            (),
            int(datetime.now(UTC).timestamp() * 1_000_000),
            available_at,
        )
        self.outbox.append((self.next_txid, row))
        self.next_txid += 1
        return row

    def take_over(self, shard: int, owner: str = "relay-2") -> None:
        """Another relay takes ``shard`` (its epoch moves on)."""
        lease = self.leases[shard]
        lease.epoch += 1
        lease.owner = owner

    # -- the relay's statements ----------------------------------------------------------------

    def snapshot(self) -> tuple[Snapshot, datetime]:
        self._maybe_fail("snapshot")
        return Snapshot(self.next_txid, self.next_txid, frozenset()), datetime.now(UTC)

    def read(
        self,
        shards: Sequence[int],
        *,
        done: Snapshot,
        reading: Snapshot,
        after_seq: int,
        page_size: int,
    ) -> list[OutboxRow]:
        self._maybe_fail("read")
        wanted = set(shards)
        rows = [
            row
            for txid, row in self.outbox
            if row.shard in wanted
            and reading.visible(txid)
            and not done.visible(txid)
            and row.seq > after_seq
        ]
        return sorted(rows, key=lambda r: r.seq)[:page_size]

    def rows(self, ids: Sequence[UUID]) -> dict[UUID, OutboxRow]:
        by_id = {row.id: row for _, row in self.outbox}
        return {i: dataclasses.replace(by_id[i], available_at=None) for i in ids if i in by_id}

    def parked(self, shards: Sequence[int]) -> list[Parking]:
        return [p for p in self.parkings.values() if p.shard in shards]

    def held_of(self, key: tuple[str, str]) -> list[tuple[int, UUID]]:
        return list(self.held.get(key, []))

    def _owns(self, shard: int, epoch: int) -> bool:
        lease = self.leases[shard]
        return lease.owner == self.owner and lease.epoch == epoch

    def record(
        self,
        progress: Sequence[ShardProgress],
        *,
        parked: Sequence[tuple[Parking, int]] = (),
        held: Sequence[Held] = (),
    ) -> set[int]:
        self._maybe_fail("record")
        recorded = {p.shard for p in progress if self._owns(p.shard, p.epoch)}
        if recorded != {p.shard for p in progress}:
            return recorded  # the real statement writes nothing of a refused write
        for item in progress:
            self.leases[item.shard].progress = item.progress
        self.park(parked)
        for row in held:
            self.positions += 1
            self.held.setdefault((row.topic, row.aggregateid), []).append(
                (self.positions, row.event_id)
            )
        self.records.append(list(progress))
        return recorded

    def park(self, parked: Sequence[tuple[Parking, int]]) -> None:
        for parking, epoch in parked:
            if self._owns(parking.shard, epoch):
                self.parkings.setdefault(parking.key, parking)

    def unpark(self, parking: Parking, *, epoch: int, published_to: int | None) -> bool:
        if not self._owns(parking.shard, epoch):
            return False
        held = [
            h for h in self.held.get(parking.key, []) if published_to is None or h[0] > published_to
        ]
        self.held[parking.key] = held
        if held:
            return False
        self.parkings.pop(parking.key, None)
        return True

    def park_failed(self, parking: Parking, *, error: str) -> None:
        self.parkings[parking.key] = dataclasses.replace(
            parking, reason="dead", error=error, request=None, due=False, until=None
        )

    def due(self, key: tuple[str, str], request: str | None = "requeue") -> None:
        """An operator releases a parked key (``oncely dead requeue``)."""
        self.parkings[key] = dataclasses.replace(self.parkings[key], request=request)

    def heartbeat(
        self, *, ttl_seconds: float, asleep: bool, leases: Sequence[tuple[int, int]] = ()
    ) -> Heartbeat:
        self._maybe_fail("heartbeat")
        kept = frozenset(s for s, e in leases if self._owns(s, e))
        return Heartbeat(alive=self.alive, shards=len(self.leases), kept=kept)

    def sleep(self, *, asleep: bool) -> None:
        self._maybe_fail("sleep")
        self.asleep = asleep

    def acquire(self, *, wanted: int, lease_seconds: float) -> list[ShardProgress]:
        taken: list[ShardProgress] = []
        for number, lease in self.leases.items():
            if len(taken) >= wanted:
                break
            if lease.owner is None:
                lease.owner, lease.epoch = self.owner, lease.epoch + 1
                taken.append(ShardProgress(number, lease.epoch, lease.progress))
        return taken

    def release(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        released = {s for s, e in leases if self._owns(s, e)}
        for shard in released:
            self.leases[shard].owner = None
        return released

    def leave(self) -> None:
        pass

    def backlog(self) -> list[ShardBacklog]:
        self.backlog_reads += 1
        return []

    def blocked_rows(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class _Headers:
    def __init__(self, event_id: str) -> None:
        self._headers = [("id", event_id.encode())]

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers


class FakePublisher:
    """Records produced rows; :meth:`poll` reports them (an error for rows ``failing`` names,
    ``KafkaError`` code per event id or per topic) and moves the clock by the wait."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.fatal: KafkaError | None = None
        self.auth_failed: KafkaError | None = None
        self.brokers_down = False
        self.sent: list[OutboxRow] = []
        self.failing: dict[str, int] = {}
        self.missing_topics: set[str] = set()
        #: Transactions to report as ended at the next :meth:`ended`.
        self.ending: list[Ended] = []
        #: Per shard, the parked rows a committed transaction released (exactly once).
        self.releases: dict[int, set[UUID]] = {}
        self._pending: list[tuple[OutboxRow, OnDelivery]] = []

    def produce(self, row: OutboxRow, report: OnDelivery) -> KafkaError | None:
        self._pending.append((row, report))
        return None

    def poll(self, timeout: float) -> None:
        pending, self._pending = self._pending, []
        for row, report in pending:
            code = self.failing.get(row.event_id, self.failing.get(row.topic))
            if code is None:
                self.sent.append(row)
                report(None, None)
            else:
                report(KafkaError(code), _Headers(row.event_id))  # type: ignore[arg-type]
        self.clock.advance(timeout)

    def flush(self, timeout: float) -> int:
        self.poll(0)
        return 0

    def reachable(self) -> None:
        self.brokers_down = False

    def topic_state(self, topic: str, *, timeout: float = 2.0) -> TopicState:
        return TopicState.MISSING if topic in self.missing_topics else TopicState.EXISTS

    def max_message_bytes(self, topic: str) -> int | None:
        return None

    def take(self, shards: Iterable[int]) -> dict[int, Progress]:
        return {}

    def commit(
        self,
        progress: ShardProgress,
        report: OnDelivery,
        *,
        abort: bool = False,
        releasing: Iterable[UUID] = (),
    ) -> bool:
        return False

    def released(self, shard: int) -> frozenset[UUID]:
        return frozenset(self.releases.get(shard, ()))

    def unparked(self, shard: int, parked: UUID) -> None:
        self.releases.get(shard, set()).discard(parked)

    def lost(self) -> set[int]:
        return set()

    def ended(self) -> Sequence[Ended]:
        ended, self.ending = self.ending, []
        return ended

    def drop(self, shard: int) -> None:
        pass

    def forget_limits(self, topic: str) -> None:
        pass

    def recreate(self) -> None:
        self.fatal = None


class FakeHousekeeping:
    def __init__(self) -> None:
        self.runs = 0

    def due(self) -> None:
        self.runs += 1

    def join(self, timeout: float) -> None:
        pass


Step = tuple[Callable[[], bool], Callable[[], None] | None]


class Until(threading.Event):
    """A stop event for a script of steps: once a step's condition holds its action runs
    (``None``: none) and the next step waits; set after the last. Fails the test after
    ``turns`` loop turns."""

    def __init__(self, steps: Sequence[Step], *, turns: int) -> None:
        super().__init__()
        self._steps = list(steps)
        self._turns = turns

    def is_set(self) -> bool:
        self._turns -= 1
        if self._turns < 0:
            raise AssertionError(f"the relay's loop did not get there ({len(self._steps)} left)")
        while self._steps and self._steps[0][0]():
            _, action = self._steps.pop(0)
            if action is not None:
                action()
        return not self._steps


@dataclass
class Loop:
    relay: Relay
    store: FakeStore
    publisher: FakePublisher
    clock: Clock
    signals: Signals
    metrics: RelayMetrics

    def run_until(self, done: Callable[[], bool], *, turns: int = 20_000) -> None:
        """Run the loop until ``done()``, then drain it."""
        self.run((done, None), turns=turns)

    def run(self, *steps: Step, turns: int = 20_000) -> None:
        """Run the loop through ``steps`` (see :class:`Until`), then drain it."""
        self.relay.run(Until(steps, turns=turns))

    def published(self) -> list[str]:
        return [row.event_id for row in self.publisher.sent]


def loop(*, shards: int = 4, alive: int = 1, **settings: object) -> Loop:
    """A relay over a fake store, producer and clock (fast leases and backoff)."""
    clock = Clock()
    store = FakeStore(shards=shards, alive=alive)
    publisher = FakePublisher(clock)
    signals = Signals()
    metrics = RelayMetrics(registry=CollectorRegistry())
    values: dict[str, object] = {
        "lease_seconds": 9.0,
        "poll_interval_seconds": 0.2,
        "initial_backoff_seconds": 0.2,
        "max_backoff_seconds": 1.0,
        "delivery_timeout_ms": 5_000,
        "shutdown_timeout_seconds": 5.0,
        "max_attempts": 2,
        **settings,
    }
    relay = Relay(
        store=store,
        publisher_factory=lambda: publisher,
        settings=RelaySettings(**values),  # type: ignore[arg-type]
        metrics=metrics,
        housekeeping=FakeHousekeeping(),
        signals=signals,
        clock=clock,
    )
    return Loop(relay, store, publisher, clock, signals, metrics)


def guard(what: str, call: Callable[[], T]) -> T | Failed:
    """The loop's database guard, without its retry time: a failed call answers ``FAILED``."""
    try:
        return call()
    except sa.exc.DBAPIError:
        return FAILED
