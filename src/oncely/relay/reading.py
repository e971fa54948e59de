"""One read of a group of shards at the same position, produced as one page per shard.

Where the page ends comes from :mod:`oncely.relay.extent` (every row read, the rows before one
the broker may refuse, or that row alone); rows of a parked key, delayed rows and rows of a
blocked topic wait (the loop's ``place`` records them on the page) and the others are produced
in ``seq`` order. A row the client refuses at once fails its shard's page: the shard's later
rows are not produced (it replays); the other shards' rows are. Gets the publisher's calls as
arguments; the loop appends the pages to their shards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from confluent_kafka import KafkaError

from oncely.failpoints import failpoint
from oncely.relay.extent import extent, first_suspect
from oncely.relay.ports import OnDelivery
from oncely.relay.shards import Failure, InFlight, Page, Shard
from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot


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
