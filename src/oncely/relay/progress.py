"""When the relay records progress: what is acknowledged and not yet recorded, and the cadence.

Progress is recorded at most every ``interval`` seconds (a crash replays what was acknowledged
since, as duplicates; a quiet service does not write after every few rows), and at once when
pages park keys or hold rows; the position of shards whose reads found nothing is recorded now
and then (:func:`quiet`: a crash then only reads empty ranges again). Pure logic: the loop tells it
what was acknowledged and recorded, with its own clock, and writes what it returns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from oncely.relay.shards import Shard
from oncely.storage.stores.outbox.relay import Held, Parking, ShardProgress


@dataclass(frozen=True, slots=True)
class Refused:
    """A progress write of which ``shards`` were refused (another relay took them over): what
    is left to record of the rest."""

    shards: frozenset[int]
    progress: list[ShardProgress]
    parked: list[tuple[Parking, int]]
    held: list[Held]


#: Progress is recorded at most this often (seconds): a crash replays what was acknowledged
#: since (duplicates), and a quiet service does not write progress after every few rows.
RECORD_INTERVAL = 0.02
#: Shards whose reads found nothing have their position recorded this often (seconds): a
#: crash only reads empty ranges again.
QUIET_RECORD_INTERVAL = 30.0


class Acknowledged:
    """Progress of acknowledged pages, by shard, waiting for the next record."""

    def __init__(self, *, interval: float = RECORD_INTERVAL) -> None:
        self._by_shard: dict[int, ShardProgress] = {}
        self._interval = interval
        self._record_after = 0.0

    def __bool__(self) -> bool:
        return bool(self._by_shard)

    def __contains__(self, shard: object) -> bool:
        return shard in self._by_shard

    def add(self, progress: ShardProgress) -> None:
        """The shard's pages up to ``progress`` are acknowledged."""
        self._by_shard[progress.shard] = progress

    def due(self, now: float, *, urgent: bool) -> bool:
        """Whether to record now: something is waiting, and it is ``urgent`` (keys parked or
        rows held) or the interval since the last record has passed."""
        return bool(self._by_shard) and (urgent or now >= self._record_after)

    def take(self, now: float) -> list[ShardProgress]:
        """Everything waiting, to record now; the next record is due ``interval`` from now."""
        taken = list(self._by_shard.values())
        self._by_shard.clear()
        self._record_after = now + self._interval
        return taken

    def drop(self, shard: int) -> None:
        """Forget the shard's progress (it replays, was lost, or was recorded otherwise)."""
        self._by_shard.pop(shard, None)

    def wait(self, now: float) -> float:
        """Seconds until what is waiting is due (infinite when nothing waits)."""
        return self._record_after - now if self._by_shard else float("inf")


def quiet(shards: Iterable[Shard]) -> list[ShardProgress]:
    """The position of ``shards`` that have nothing in flight and have read past their record."""
    return [
        ShardProgress(s.shard, s.epoch, s.cursor)
        for s in shards
        if not s.pages and s.cursor != s.recorded
    ]


def refused(
    progress: list[ShardProgress],
    parked: list[tuple[Parking, int]],
    held: list[Held],
    *,
    recorded: Collection[int],
) -> Refused | None:
    """The part of a write to retry when only ``recorded`` shards were recorded, ``None`` when
    every shard was."""
    shards = frozenset(p.shard for p in progress) - frozenset(recorded)
    if not shards:
        return None
    return Refused(
        shards,
        [p for p in progress if p.shard not in shards],
        [(p, e) for p, e in parked if p.shard not in shards],
        [h for h in held if h.shard not in shards],
    )
