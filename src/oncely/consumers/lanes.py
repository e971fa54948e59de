"""Applying one batch at a time: in one transaction, or an ``async`` effect's in lanes.

:func:`split_lanes` shares records over lanes by record key (``ONCELY_CONSUMER_LANES``): a key
always lands on the same lane, so its records apply in order, while other keys proceed in
parallel. :class:`Lanes` applies one batch at a time: a sync effect's in one transaction, an
``async`` effect's split over lanes that are concurrent tasks on one asyncio event loop, each
in its own transaction; :func:`merge_results` gives the offsets to commit: a partition's never
passes its lowest record that was not applied. (A sync effect's lanes keep taking work instead
of waiting for a batch: :mod:`.workers`.)
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from oncely.consumers.apply import (
    Applier,
    BatchResult,
    Failure,
    PartitionId,
    Record,
)


class Lanes:
    """Applies batches through ``applier`` (an ``async`` effect's in ``count`` lanes, on the
    applier's async engine, which :meth:`close` disposes); used from one thread (the apply
    thread), which must also :meth:`close` it."""

    def __init__(self, applier: Applier, count: int) -> None:
        self.count = count
        self._applier = applier
        self._async_engine = applier.async_engine
        self._event_loop: asyncio.Runner | None = None  # created on the apply thread

    def apply(self, records: Sequence[Record]) -> list[BatchResult]:
        """Apply one batch: one transaction (per lane); never raises (see ``Applier.apply``)."""
        if self._async_engine is not None:
            if self._event_loop is None:
                self._event_loop = asyncio.Runner()
            runs = split_lanes(records, self.count) if self.count > 1 else [records]
            return self._event_loop.run(self._apply_async(runs))
        return [self._applier.apply(records)]

    async def _apply_async(self, runs: Sequence[Sequence[Record]]) -> list[BatchResult]:
        return list(await asyncio.gather(*(self._applier.apply_async(run) for run in runs)))

    def close(self) -> None:
        """Dispose the async engine and its event loop."""
        if self._event_loop is not None:
            if self._async_engine is not None:
                self._event_loop.run(self._async_engine.dispose())
            self._event_loop.close()
            self._event_loop = None


def async_engine(engine: sa.Engine, lanes: int) -> AsyncEngine:
    """The asyncio engine of an ``async`` effect's lanes: on ``engine``'s database (psycopg 3's
    async driver), one connection per lane."""
    url = engine.url.set(drivername="postgresql+psycopg")
    return create_async_engine(url, pool_size=max(2, lanes), pool_pre_ping=True)


def split_lanes(
    records: Sequence[Record], lanes: int, *, keep_empty: bool = False
) -> list[list[Record]]:
    """``records`` shared over ``lanes`` runs by key (by partition for keyless records).

    A key always maps to the same lane, and each run keeps the batch's order. Empty runs are
    left out, unless ``keep_empty`` (then run ``i`` is lane ``i``'s).
    """
    runs: list[list[Record]] = [[] for _ in range(lanes)]
    for record in records:
        message = record.message
        key = message.key()
        basis = key if isinstance(key, bytes) else str(message.partition()).encode()
        runs[lane_of(basis, lanes)].append(record)
    return runs if keep_empty else [run for run in runs if run]


def lane_of(key: bytes, lanes: int) -> int:
    """The lane of records with ``key`` among ``lanes``: the high half of its CRC-32, modulo.

    Not ``crc32(key) % lanes``: librdkafka's default partitioner is ``crc32(key) % partitions``,
    so with, say, 6 partitions and 8 lanes a partition's keys would land on only half the lanes
    (both moduli see the same low bits), and a fetch of one partition would feed only those.
    """
    return (zlib.crc32(key) >> 16) % lanes


def merge_results(
    results: Iterable[BatchResult],
) -> tuple[dict[PartitionId, int], list[Failure]]:
    """The offsets to commit per partition, and the record each stopped partition stopped at.

    A partition's offset is the one after its last record done, unless a record of it failed in
    some lane: then it is the lowest failed record's offset (commit only below the lowest
    unfinished one), and that record's failure is the one the policy acts on.
    """
    next_offsets: dict[PartitionId, int] = {}
    stops: dict[PartitionId, Failure] = {}
    for result in results:
        for tp, offset in result.done.items():
            next_offsets[tp] = max(next_offsets.get(tp, offset), offset)
        for failure in result.failures:
            tp = failure.partition_id
            if tp not in stops or failure.offset < stops[tp].offset:
                stops[tp] = failure
    for tp, failure in stops.items():
        next_offsets[tp] = failure.offset
    return next_offsets, list(stops.values())
