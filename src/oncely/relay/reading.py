"""Reading the shards ready to read and producing what was read, one page per shard.

A read takes one page per group of shards at the same position (:meth:`ShardTable.groups`),
bounded by the room left under ``max_in_flight``; while pages come back full (a large backlog)
the next asks for twice as many rows, up to half that bound.

Where the page ends comes from :mod:`oncely.relay.extent` (every row read, the rows before one
the broker may refuse, or that row alone); rows of a parked key, delayed rows and rows of a
blocked topic wait (the loop's ``place`` records them on the page) and the others are produced
in ``seq`` order. A row the client refuses at once fails its shard's page: the shard's later
rows are not produced (it replays); the other shards' rows are. Gets the store and the
publisher as arguments, and calls the database through the loop's guard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import KafkaError

from oncely.failpoints import failpoint
from oncely.relay.extent import extent, first_suspect
from oncely.relay.ports import FAILED, Guard, OnDelivery, Sources
from oncely.relay.shards import Failure, InFlight, Page, Shard, ShardTable
from oncely.relay.topics import TopicState
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot


class Waiting(Protocol):
    """What reading asks of the parked keys (:class:`oncely.relay.parking.ParkedKeys`)."""

    def __bool__(self) -> bool: ...

    def waits(self, row: OutboxRow) -> bool: ...

    def place(
        self,
        row: OutboxRow,
        page: Page,
        *,
        blocked: Collection[str],
        state_of: Callable[[str], TopicState],
    ) -> bool: ...


@dataclass(slots=True)
class Read:
    """What a read did: rows read, whether it reached the end of what was committed (every
    shard held was read and none had more left), and the rows the client refused at once."""

    rows: int = 0
    complete: bool = True
    refused: list[tuple[OutboxRow, KafkaError]] = field(default_factory=list)


def read(
    sources: Sources,
    shards: ShardTable,
    *,
    waiting: Waiting,
    suspects: Collection[object],
    now: Callable[[], float],
    db: Guard,
) -> Read:
    """Read one page per group of shards at the same position and produce it; a database
    failure ends the read where it is (what was produced stays in flight)."""
    settings, done = sources.settings, Read()
    room = settings.max_in_flight - shards.in_flight.count
    if room <= 0:
        done.complete = False
        return done
    fresh: Snapshot | None = None
    groups = shards.groups(
        now=now(), margin=settings.lease_seconds / 3, one_page=settings.exactly_once
    )
    done.complete = sum(len(m) for m in groups.values()) == len(shards) - len(shards.handing_off())
    for cursor, members in groups.items():
        if cursor.reading is None and fresh is None:
            taken = db("snapshot", sources.store.snapshot)
            if taken is FAILED:
                done.complete = False
                return done
            fresh = taken[0]
        reading = cursor.reading or fresh
        assert reading is not None
        page = _page(sources, shards, cursor, members, reading, room, waiting, suspects, now, db)
        if page is None:
            done.complete = False
            return done
        rows, ended, refused = page
        done.rows += rows
        done.refused += refused
        room -= rows
        done.complete = done.complete and ended
        if room <= 0:
            done.complete = False
            return done
    return done


def _page(
    sources: Sources,
    shards: ShardTable,
    cursor: Progress,
    members: list[Shard],
    reading: Snapshot,
    room: int,
    waiting: Waiting,
    suspects: Collection[object],
    now: Callable[[], float],
    db: Guard,
) -> tuple[int, bool, list[tuple[OutboxRow, KafkaError]]] | None:
    """Read ``members`` from ``cursor`` and produce what was read, a page per shard; the rows
    read, whether ``reading`` is read to its end and the rows refused, or ``None`` when the
    database failed."""
    settings, topics = sources.settings, sources.topics
    # Exactly once, a shard's page is its own transaction: a read's rows spread over its shards,
    # so it reads a page for each shard (up to the room left) rather than one for them all.
    first = settings.batch_size * (len(members) if settings.exactly_once else 1)
    grown = min(s.page_size or first for s in members)
    page_size = min(room, grown)
    rows = db(
        "read",
        lambda: sources.store.read(
            [s.shard for s in members],
            done=cursor.done,
            reading=reading,
            after_seq=cursor.after_seq,
            page_size=page_size,
        ),
    )
    if rows is FAILED:
        return None
    blocked = frozenset(t for t in {row.topic for row in rows} if topics.is_blocked(t))
    read = cut(
        rows,
        cursor=cursor,
        reading=reading,
        page_size=page_size,
        members=members,
        waits=lambda row: (
            row.delayed or (bool(waiting) and waiting.waits(row)) or row.topic in blocked
        ),
        suspects=suspects,
        limit_of=sources.publisher.max_message_bytes,
    )
    if read is None:
        return 0, False, []
    # At least once, two reads fill the records in flight; exactly once, a shard has one page
    # in flight and a read's every shard waits for its commit: one read fills them.
    cap = max(settings.batch_size, settings.max_in_flight // (1 if settings.exactly_once else 2))
    for shard in read.members:
        shard.page_size = min(cap, grown * 2) if len(read.rows) == page_size else 0
    pages: dict[int, Page] = {}
    refused: list[tuple[OutboxRow, KafkaError]] = []
    if read.rows:
        failpoint("relay.after_read")
        place = functools.partial(waiting.place, blocked=blocked, state_of=topics.state)
        pages, refused = produce(
            read,
            in_flight=shards.in_flight,
            deadline=now() + settings.delivery_timeout_ms / 1000,
            send=sources.publisher.produce,
            waits=place if waiting or blocked or any(r.delayed for r in read.rows) else None,
        )
    for shard in read.members:
        shard.cursor = read.ends
        page = pages.get(shard.shard)
        if page is not None and page.produced:
            _end(sources, shard, page, db)
        if page is not None and page.has_writes:
            shard.add(page)
        elif shard.pages:  # its progress is recorded after the pages in flight
            shard.add(Page(shard.shard, read.ends, shards.in_flight))
    return len(read.rows), read.ends.reading is None, refused


def _end(sources: Sources, shard: Shard, page: Page, db: Guard) -> None:
    """End ``page``'s transaction, in exactly-once mode: commit it with its progress, the keys
    it parks and rows it holds written first (a relay that takes the shard over after the commit
    and before its progress is recorded finds them); abort it when a row failed, or that write
    did."""
    if (page.parked or page.held) and page.failure is None and sources.settings.exactly_once:
        parked = [(parking, shard.epoch) for parking in page.parked]
        here = ShardProgress(shard.shard, shard.epoch, shard.recorded)
        written = db("park", lambda: sources.store.record([here], parked=parked, held=page.held))
        if written is FAILED or shard.shard not in written:
            page.failure = Failure(page.produced[-1], KafkaError(KafkaError._FAIL), own=False)
        else:
            page.parked, page.held = [], []
    progress = ShardProgress(shard.shard, shard.epoch, page.ends)
    if sources.publisher.commit(progress, page.report, abort=page.failure is not None):
        page.awaits_commit()


@dataclass(frozen=True, slots=True)
class Cut:
    """The rows of a read to produce, where the read ends, and the shards it moves: all of
    the group, or only the shard of a row that goes out alone (``isolated``)."""

    rows: list[OutboxRow]
    ends: Progress
    isolated: bool
    members: list[Shard]


def cut(
    rows: list[OutboxRow],
    *,
    cursor: Progress,
    reading: Snapshot,
    page_size: int,
    members: list[Shard],
    waits: Callable[[OutboxRow], bool],
    suspects: Collection[object],
    limit_of: Callable[[str], int | None],
) -> Cut | None:
    """Where a read of ``members`` ends (``None``: the group waits for a row that must go out
    alone). The shards left behind by a row going out alone are moved past it here."""
    suspect = first_suspect(rows, waiting=waits, suspects=suspects, limit_of=limit_of)
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
    if ends.alone is None:
        return Cut(list(ends.rows), ends.ends, False, members)
    for shard in members:
        if shard.shard != ends.alone:
            shard.cursor = ends.ends
    return Cut(list(ends.rows), ends.ends, True, [shards[ends.alone]])


def produce(
    read: Cut,
    *,
    in_flight: InFlight,
    deadline: float,
    send: Callable[[OutboxRow, OnDelivery], KafkaError | None],
    waits: Callable[[OutboxRow, Page], bool] | None,
) -> tuple[dict[int, Page], list[tuple[OutboxRow, KafkaError]]]:
    """Produce ``read``'s rows with ``send``, each on its shard's page (reports due by
    ``deadline``); ``waits(row, page)`` keeps a row back (recording it on the page; ``None``:
    no row waits). Returns the pages and the rows the client refused at once."""
    rows = read.rows
    pages: dict[int, Page] = {}
    refused: list[tuple[OutboxRow, KafkaError]] = []
    for row in rows:
        if row.shard not in pages:
            pages[row.shard] = Page(
                row.shard, read.ends, in_flight, isolated=read.isolated, deadline=deadline
            )
    middle = len(rows) // 2
    for index, row in enumerate(rows):
        page = pages[row.shard]
        if page.failure is not None or (waits is not None and waits(row, page)):
            continue
        page.rows += 1
        error = send(row, page.report)
        if error is not None:
            refused.append((row, error))
            page.failure = Failure(row, error, own=True)
            continue
        page.sent(row)
        if index == middle:
            failpoint("relay.mid_page")
    if rows:
        failpoint("relay.after_produce_before_ack")
    return pages, refused
