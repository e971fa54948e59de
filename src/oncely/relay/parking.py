"""The keys the relay holds back: parked (dead, delayed, or blocked on a missing topic) and the
rows read behind them (held), and which keys are due for release.

A key is parked by one row: dead-lettered, delayed (``available_at`` ahead), or blocked (its
topic missing or not authorised). Rows of a parked key read later are held: recorded with the
page, and published, in order, when the key is released (an operator's ``oncely dead
requeue|skip``, the delay passing, or the topic appearing). Only the relay holding a shard parks
its keys, so the parked keys of the shards it holds are read when it takes them, refreshed at
each heartbeat and otherwise known here.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from oncely.relay.shards import Page
from oncely.relay.topics import TopicState
from oncely.storage.stores.outbox.relay import Held, Parking
from oncely.storage.stores.outbox.rows import OutboxRow


class ParkedKeys:
    """The parked keys of the shards held, by (topic, key)."""

    def __init__(self) -> None:
        self._parked: dict[tuple[str, str], Parking] = {}

    def __bool__(self) -> bool:
        return bool(self._parked)

    def __contains__(self, key: object) -> bool:
        return key in self._parked

    def park(self, parking: Parking) -> None:
        self._parked[parking.key] = parking

    def add(self, parked: Iterable[Parking]) -> None:
        """Keys read from the database (a shard was taken)."""
        self._parked.update({p.key: p for p in parked})

    def released(self, parking: Parking) -> None:
        self._parked.pop(parking.key, None)

    def dead(self, parking: Parking, error: str) -> None:
        """A released key's own row failed for good: it stays parked, now as dead."""
        self._parked[parking.key] = dataclasses.replace(
            parking, reason="dead", error=error, until=None, request=None, due=False
        )

    def refresh(self, parked: Iterable[Parking], *, pending: Iterable[Page]) -> None:
        """The keys read from the database again; keys parked by ``pending`` pages (in flight,
        not recorded yet) stay parked."""
        self._parked = {
            **{p.key: p for page in pending for p in page.parked},
            **{p.key: p for p in parked},
        }

    def drop_pages(self, pages: Iterable[Page]) -> None:
        """Keys parked by ``pages`` (dropped: their shard replays) are not parked any more."""
        parked = self._parked
        for page in pages:
            for parking in page.parked:
                if parked.get(parking.key) is parking:
                    del parked[parking.key]

    def drop_shard(self, shard: int) -> None:
        """Forget the keys of a shard no longer held."""
        for key in [k for k, p in self._parked.items() if p.shard == shard]:
            del self._parked[key]

    def any_blocked(self) -> bool:
        return any(p.reason == "blocked" for p in self._parked.values())

    def waits(self, row: OutboxRow) -> bool:
        """Whether ``row``'s key is parked (the row is not produced now)."""
        return row.parking_key in self._parked

    def place(
        self,
        row: OutboxRow,
        page: Page,
        *,
        blocked: Collection[str],
        state_of: Callable[[str], TopicState],
    ) -> bool:
        """Whether ``row`` waits instead of being produced; if so it is on ``page``: held behind
        its parked key (unless it is the parked row itself), or parking its key (delayed, or
        its topic ``blocked``: ``state_of`` tells missing from not authorised)."""
        parking = self._parked.get(row.parking_key) if self._parked else None
        if parking is not None:
            if parking.event_id != row.id:
                page.held.append(Held(row.id, row.topic, row.aggregateid, row.shard))
            return True
        if row.delayed or (blocked and row.topic in blocked):
            parking = parking_of(row, state_of)
            self._parked[parking.key] = parking
            page.parked.append(parking)
            return True
        return False

    def due(self, is_blocked: Callable[[str], bool]) -> dict[int, list[Parking]]:
        """The parked keys to release now, by shard: an operator asked, their delay passed, or
        their blocked topic exists (``is_blocked`` is asked once per topic)."""
        due: dict[int, list[Parking]] = {}
        blocked: dict[str, bool] = {}
        for parking in self._parked.values():
            if parking.request is None and not parking.due:
                if parking.reason != "blocked":
                    continue
                topic = parking.topic
                if topic not in blocked:
                    blocked[topic] = is_blocked(topic)
                if blocked[topic]:
                    continue
            due.setdefault(parking.shard, []).append(parking)
        return due


def held_keys(parked: Iterable[Parking], shards: Iterable[int]) -> dict[int, int]:
    """Parked keys per shard of ``shards``."""
    counts = Counter(p.shard for p in parked)
    return {shard: counts.get(shard, 0) for shard in shards}


def parking_of(row: OutboxRow, state_of: Callable[[str], TopicState]) -> Parking:
    """The parking of a row that cannot go out now: delayed, or its topic blocked."""
    if row.delayed:
        return Parking(
            row.topic, row.aggregateid, row.shard, row.id, "delayed", until=row.available_at
        )
    state = "not authorised" if state_of(row.topic) is TopicState.DENIED else "missing"
    return Parking(
        row.topic,
        row.aggregateid,
        row.shard,
        row.id,
        "blocked",
        error=f"topic {row.topic} is {state}",
    )
