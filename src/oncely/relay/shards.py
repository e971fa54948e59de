"""The shards one relay holds: each one's lease, position, pages in flight and phase.

The types the relay's parts share: a part reads shards and pages and returns a decision; only
the loop (:mod:`oncely.relay.relay`) changes the table. A shard's :class:`Phase` says what the
loop may do with it, and changes only through :meth:`Shard.enter`, which logs each transition
and refuses an illegal one (a shard handing off never reads again).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, Message

from oncely.runtime.retry import Backoff
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow

log = logging.getLogger(__name__)


class InFlight:
    """Records produced and not yet reported, over every page (shared by the pages)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


@dataclass(frozen=True, slots=True)
class Failure:
    """A shard's first failed row of a page; ``own``: nothing else of its shard was in flight
    (produced alone, or refused at once), so the error is the row's own."""

    row: OutboxRow
    error: KafkaError
    own: bool


@dataclass(eq=False)
class Page:
    """One shard's rows of one read, produced together; its progress moves when all are acked."""

    shard: int
    ends: Progress
    in_flight: InFlight
    rows: int = 0
    outstanding: int = 0
    #: The rows produced, in order.
    produced: list[OutboxRow] = field(default_factory=list)
    #: Failed delivery reports not yet looked at (:func:`oncely.relay.settle.take_errors`).
    errors: list[tuple[KafkaError, Message | None]] = field(default_factory=list)
    failure: Failure | None = None
    #: One row the broker may refuse, produced alone (:mod:`oncely.relay.extent`).
    isolated: bool = False
    #: When its reports are overdue (monotonic): the shard replays (delivery_timeout_ms).
    deadline: float = math.inf
    parked: list[Parking] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    #: A Kafka transaction (exactly-once mode): its commit is the page's last report.
    transaction: bool = False

    @property
    def acknowledged(self) -> bool:
        return self.outstanding == 0 and self.failure is None

    @property
    def failed(self) -> bool:
        """The page failed and its shard may replay: at once, unless its transaction has yet
        to commit or abort (a replay must not race records that may still become visible)."""
        return self.failure is not None and not (self.transaction and self.outstanding)

    def awaits_commit(self) -> None:
        """The page's records are in a transaction whose commit (or abort) reports last; it is
        never overdue (the transaction's own timeout ends it)."""
        self.transaction = True
        self.outstanding += 1
        self.in_flight.count += 1
        self.deadline = math.inf

    @property
    def has_writes(self) -> bool:
        return bool(self.rows or self.parked or self.held)

    def sent(self, row: OutboxRow) -> None:
        """``row`` was handed to the producer: its report is awaited."""
        self.outstanding += 1
        self.in_flight.count += 1
        self.produced.append(row)

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


class Phase(enum.Enum):
    """What the loop does with a shard."""

    #: Read and produced every turn.
    READING = "reading"
    #: One row the broker may refuse is in flight alone: nothing more is read until it settles.
    ALONE = "alone"
    #: Replaying after a failure: read again from its recorded progress once ``retry_at``.
    BACKING_OFF = "backing off"
    #: Parked keys are due: not read until their rows are published (or the release fails).
    RELEASING = "releasing"
    #: Over the fair share, or draining: never read again; given back once nothing is in flight.
    HANDING_OFF = "handing off"


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.READING: frozenset({Phase.ALONE, Phase.BACKING_OFF, Phase.RELEASING, Phase.HANDING_OFF}),
    Phase.ALONE: frozenset({Phase.READING, Phase.BACKING_OFF, Phase.RELEASING, Phase.HANDING_OFF}),
    Phase.BACKING_OFF: frozenset({Phase.READING, Phase.HANDING_OFF}),
    Phase.RELEASING: frozenset({Phase.READING, Phase.BACKING_OFF, Phase.HANDING_OFF}),
    Phase.HANDING_OFF: frozenset(),
}


@dataclass(eq=False)
class Shard:
    """A shard held under ``epoch``: ``recorded`` is its progress in the database, ``cursor``
    where its next read starts."""

    shard: int
    epoch: int
    recorded: Progress
    cursor: Progress
    lease_deadline: float
    #: Where a replay starts: ``recorded``, or in exactly-once mode the end of its last
    #: committed transaction when that is ahead (its records are visible: never again).
    committed: Progress | None = None
    pages: deque[Page] = field(default_factory=deque)
    phase: Phase = Phase.READING
    #: Replays since progress was last recorded (the backoff grows with them).
    attempts: int = 0
    retry_at: float = 0.0
    #: Rows asked for by the next read; doubles while reads come back full.
    page_size: int = 0

    def enter(self, phase: Phase) -> bool:
        """Move to ``phase``; whether it moved (already there: ``True``). An illegal move (out of
        handing off, or from backing off straight to releasing) is refused and logged."""
        if phase is self.phase:
            return True
        if phase not in _ALLOWED[self.phase]:
            log.debug("shard %d stays %s (not %s)", self.shard, self.phase.value, phase.value)
            return False
        log.debug("shard %d: %s -> %s", self.shard, self.phase.value, phase.value)
        self.phase = phase
        return True

    def take_acknowledged(self) -> list[Page]:
        """Remove and return the pages at the front whose records are all acknowledged."""
        pages = self.pages
        taken: list[Page] = []
        while pages and pages[0].acknowledged:
            taken.append(pages.popleft())
        if taken and not pages and self.phase is Phase.ALONE:
            self.enter(Phase.READING)
        return taken

    def add(self, page: Page) -> None:
        """A page was read and produced; an isolated one makes the shard wait for it alone."""
        self.pages.append(page)
        if page.isolated:
            self.enter(Phase.ALONE)

    def drop_pages(self) -> list[Page]:
        """Abandon every page in flight (their reports no longer count) and return them."""
        dropped = list(self.pages)
        for page in dropped:
            page.abandon()
        self.pages.clear()
        return dropped


class ShardTable:
    """The shards held, the records in flight over all of them, and each one's backoff."""

    def __init__(self, backoff: Backoff) -> None:
        self._shards: dict[int, Shard] = {}
        self._backoff = backoff
        self._releasing: frozenset[int] = frozenset()
        self.in_flight = InFlight()

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._shards.values())

    def __len__(self) -> int:
        return len(self._shards)

    def __contains__(self, number: object) -> bool:
        return number in self._shards

    def get(self, number: int) -> Shard | None:
        return self._shards.get(number)

    def numbers(self) -> frozenset[int]:
        return frozenset(self._shards)

    def leases(self) -> list[tuple[int, int]]:
        """(shard, epoch) of every shard held."""
        return [(s.shard, s.epoch) for s in self._shards.values()]

    def epoch_of(self, number: int) -> int:
        """The epoch ``number`` is held under (-1: not held, so no write of it is accepted)."""
        shard = self._shards.get(number)
        return shard.epoch if shard is not None else -1

    def take(self, lease: ShardProgress, *, lease_deadline: float) -> Shard:
        """A shard just leased, read from its recorded progress."""
        shard = Shard(
            lease.shard, lease.epoch, lease.progress, lease.progress, lease_deadline, lease.progress
        )
        self._shards[lease.shard] = shard
        return shard

    def drop(self, number: int) -> Shard | None:
        """Forget a shard (lost, or given back) and abandon its pages."""
        shard = self._shards.pop(number, None)
        if shard is not None:
            shard.drop_pages()
        return shard

    def renewed(self, lease_deadline: float) -> None:
        for shard in self._shards.values():
            shard.lease_deadline = lease_deadline

    def reset(self, shard: Shard, *, backoff: bool, now: float) -> list[Page]:
        """Drop what ``shard`` has in flight: it reads again from its recorded progress, after
        a backoff when ``backoff``. Returns the pages dropped."""
        dropped = shard.drop_pages()
        shard.cursor = shard.committed or shard.recorded
        if backoff:
            shard.attempts += 1
            if shard.enter(Phase.BACKING_OFF):
                shard.retry_at = now + self._backoff.delay(shard.attempts)
        elif shard.phase is Phase.ALONE:
            shard.enter(Phase.READING)
        return dropped

    def recorded(self, progress: ShardProgress) -> None:
        """``progress`` is now in the database: the shard's replays start over from it."""
        shard = self._shards.get(progress.shard)
        if shard is not None:
            shard.recorded = progress.progress
            shard.attempts = 0
            if shard.committed is None or not shard.committed.beyond(progress.progress):
                shard.committed = progress.progress

    def committed(self, progress: ShardProgress) -> None:
        """``progress`` ends a transaction just committed: the shard never replays before it."""
        shard = self._shards.get(progress.shard)
        if shard is not None:
            shard.committed = progress.progress

    def wake(self, now: float) -> None:
        """Shards whose backoff has passed read again."""
        for shard in self._shards.values():
            if shard.phase is Phase.BACKING_OFF and shard.retry_at <= now:
                shard.enter(Phase.READING)

    def releasing(self, due: frozenset[int]) -> None:
        """The shards with parked keys ``due`` stop reading until they are released; the others
        read again."""
        if not due and not self._releasing:
            return
        for shard in self._shards.values():
            if shard.shard in due:
                if shard.phase in (Phase.READING, Phase.ALONE):
                    shard.enter(Phase.RELEASING)
            elif shard.phase is Phase.RELEASING:
                shard.enter(Phase.READING)
        self._releasing = due

    def hand_off(self, numbers: tuple[int, ...] | None = None) -> None:
        """Stop reading ``numbers`` (every shard: ``None``) to give them back."""
        for shard in self._shards.values():
            if numbers is None or shard.shard in numbers:
                shard.enter(Phase.HANDING_OFF)

    def groups(
        self, *, now: float, margin: float, one_page: bool = False
    ) -> dict[Progress, list[Shard]]:
        """The shards to read now, grouped by position (a group is read by one statement):
        reading, and their lease not within ``margin`` seconds of its end; with ``one_page``
        (a shard's page is a transaction, one at a time), only those with no page in flight."""
        groups: dict[Progress, list[Shard]] = {}
        for shard in self._shards.values():
            if (
                shard.phase is Phase.READING
                and now < shard.lease_deadline - margin
                and not (one_page and shard.pages)
            ):
                groups.setdefault(shard.cursor, []).append(shard)
        return groups

    def ready_to_hand_off(self) -> list[Shard]:
        """Shards handing off with nothing in flight."""
        return [s for s in self._shards.values() if s.phase is Phase.HANDING_OFF and not s.pages]

    def handing_off(self) -> frozenset[int]:
        return frozenset(s.shard for s in self._shards.values() if s.phase is Phase.HANDING_OFF)
