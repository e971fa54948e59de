"""What the relay's loop needs of PostgreSQL, of Kafka and of its purge timer, as protocols:
:class:`~oncely.storage.stores.outbox.relay.RelayStore`,
:class:`~oncely.relay.publisher.Publisher` and :class:`~oncely.relay.housekeeping.Housekeeping`
implement them, and the unit tests run the loop on fakes of each. Parts that call the database
for the loop do it through its :class:`Guard`, which answers :data:`FAILED` for a failed call."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar
from uuid import UUID

from confluent_kafka import KafkaError, Message

from oncely.relay.topics import TopicState, TopicWatch
from oncely.relay.transactions import Ended
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

OnDelivery = Callable[[KafkaError | None, Message | None], None]
T = TypeVar("T")


class Failed(enum.Enum):
    """A database call that failed: the guard logged it and set the loop's retry time."""

    FAILED = "failed"


FAILED = Failed.FAILED


class Guard(Protocol):
    """The loop's database call: ``call()``'s result, or :data:`FAILED` when the database
    failed (logged as ``database <what> failed``; the loop serves delivery reports only until
    its retry time)."""

    def __call__(self, what: str, call: Callable[[], T]) -> T | Failed: ...


class RelayStore(Protocol):
    """The relay's statements; each raises ``sqlalchemy.exc.DBAPIError`` when the database
    fails, and a write fenced by a lease epoch changes nothing of a shard taken over."""

    @property
    def owner(self) -> str: ...

    def snapshot(self) -> tuple[Snapshot, datetime]: ...

    def read(
        self,
        shards: Sequence[int],
        *,
        done: Snapshot,
        reading: Snapshot,
        after_seq: int,
        page_size: int,
    ) -> list[OutboxRow]: ...

    def rows(self, ids: Sequence[UUID]) -> dict[UUID, OutboxRow]: ...

    def parked(self, shards: Sequence[int]) -> list[Parking]: ...

    def held_of(self, key: tuple[str, str]) -> list[tuple[int, UUID]]: ...

    def record(
        self,
        progress: Sequence[ShardProgress],
        *,
        parked: Sequence[tuple[Parking, int]] = (),
        held: Sequence[Held] = (),
    ) -> set[int]: ...

    def park(self, parked: Sequence[tuple[Parking, int]]) -> None: ...

    def unpark(self, parking: Parking, *, epoch: int, published_to: int | None) -> bool: ...

    def park_failed(self, parking: Parking, *, error: str) -> None: ...

    def heartbeat(
        self, *, ttl_seconds: float, asleep: bool, leases: Sequence[tuple[int, int]] = ()
    ) -> Heartbeat: ...

    def sleep(self, *, asleep: bool) -> None: ...

    def acquire(self, *, wanted: int, lease_seconds: float) -> list[ShardProgress]: ...

    def release(self, leases: Sequence[tuple[int, int]]) -> set[int]: ...

    def leave(self) -> None: ...

    def backlog(self) -> list[ShardBacklog]: ...

    def blocked_rows(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class Publisher(Protocol):
    """The relay's producer: a record's result comes to its report from :meth:`poll`. In
    exactly-once mode a page is a transaction: :meth:`take` starts a shard's (and says where
    Kafka has it), :meth:`commit` ends a page's, :meth:`lost` names the shards whose
    producer cannot go on and :meth:`ended` the transactions that ended (each reported once),
    and :meth:`released` the parked keys a committed transaction released until
    :meth:`unparked` says PostgreSQL recorded it; at least once, they do nothing."""

    fatal: KafkaError | None
    auth_failed: KafkaError | None

    @property
    def brokers_down(self) -> bool: ...

    def produce(self, row: OutboxRow, report: OnDelivery) -> KafkaError | None: ...

    def reachable(self) -> None: ...

    def topic_state(self, topic: str, *, timeout: float = ...) -> TopicState: ...

    def max_message_bytes(self, topic: str) -> int | None: ...

    def forget_limits(self, topic: str) -> None: ...

    def poll(self, timeout: float) -> None: ...

    def flush(self, timeout: float) -> int: ...

    def recreate(self) -> None: ...

    def take(self, shards: Iterable[int]) -> dict[int, Progress]: ...

    def commit(
        self,
        progress: ShardProgress,
        report: OnDelivery,
        *,
        abort: bool = ...,
        releasing: Iterable[UUID] = ...,
    ) -> bool: ...

    def released(self, shard: int) -> frozenset[UUID]: ...

    def unparked(self, shard: int, parked: UUID) -> None: ...

    def lost(self) -> set[int]: ...

    def ended(self) -> Sequence[Ended]: ...

    def drop(self, shard: int) -> None: ...


class Housekeeper(Protocol):
    """The relay's purge timer, run off the loop."""

    def due(self) -> None: ...

    def join(self, timeout: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Sources:
    """What the loop reads from and writes to, for the parts that call them on its behalf: the
    store, the publisher, the watch over blocked topics, and the relay's settings."""

    store: RelayStore
    publisher: Publisher
    topics: TopicWatch
    settings: RelaySettings
