"""Where a read's page ends: every row read, the rows before one the broker may refuse, or that
row alone (pure logic; the loop applies the answer).

A row *may be refused* when it failed before (a *suspect*) or is larger than its topic's
``max.message.bytes``. It goes out alone, once its shard has nothing in flight, so its refusal
is its own and no later row of its key (nor a batch-mate) can pass it; the other shards read
with it move past it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot


@dataclass(frozen=True, slots=True)
class Extent:
    """The rows to produce and where the read ends; ``alone``: the shard of the one row that
    goes out alone (the other shards of the group end at ``ends`` without it)."""

    rows: Sequence[OutboxRow]
    ends: Progress
    alone: int | None = None


def first_suspect(
    rows: Sequence[OutboxRow],
    *,
    waiting: Callable[[OutboxRow], bool],
    suspects: Collection[object],
    limit_of: Callable[[str], int | None],
) -> int | None:
    """The index of the first row the broker may refuse, ``None`` if none; rows ``waiting``
    (parked or held: not produced now) are passed over."""
    limits: dict[str, int | None] = {}
    for index, row in enumerate(rows):
        if waiting(row):
            continue
        if suspects and row.id in suspects:
            return index
        if row.topic in limits:
            limit = limits[row.topic]
        else:
            limit = limits[row.topic] = limit_of(row.topic)
        if limit is not None and row.size > limit:
            return index
    return None


def extent(
    rows: Sequence[OutboxRow],
    *,
    cursor: Progress,
    reading: Snapshot,
    page_size: int,
    suspect: int | None,
    busy: Callable[[int], bool],
) -> Extent | None:
    """Where a read of ``page_size`` rows from ``cursor`` in ``reading`` ends.

    ``suspect``: the index of the first row that may be refused; ``busy(shard)``: whether the
    shard has records in flight. ``None``: the suspect row comes first and its shard is busy,
    so the group waits (other groups go on).
    """
    if suspect is None:
        if len(rows) < page_size:
            return Extent(rows, Progress(reading))
        return Extent(rows, Progress(cursor.done, reading, rows[-1].seq))
    if suspect > 0:
        return Extent(rows[:suspect], Progress(cursor.done, reading, rows[suspect - 1].seq))
    row = rows[0]
    if busy(row.shard):
        return None
    return Extent([row], Progress(cursor.done, reading, row.seq), alone=row.shard)
