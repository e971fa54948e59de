"""Which rows wait behind parked keys, and which keys are due (pure)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from oncely.relay.parking import ParkedKeys, held_keys, parking_of
from oncely.relay.shards import InFlight, Page
from oncely.relay.topics import TopicState
from oncely.storage.stores.outbox.relay import Held, Parking, Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

END = Progress(Snapshot(1, 1, frozenset()))


def _row(key: str, *, topic: str = "t", delayed: bool = False) -> OutboxRow:
    at = datetime(2030, 1, 1, tzinfo=UTC) if delayed else None
    return OutboxRow(str(uuid.uuid4()), 1, 0, topic, key, "e", b"x", (), 0, at)


def _page() -> Page:
    return Page(0, END, InFlight())


def _exists(topic: str) -> TopicState:
    return TopicState.EXISTS


def test_rows_of_a_parked_key_are_held_and_the_parked_row_itself_is_neither() -> None:
    keys = ParkedKeys()
    parked_row = _row("a")
    keys.park(Parking("t", "a", 0, parked_row.id, "dead"))
    page = _page()
    later = _row("a")
    assert keys.place(later, page, blocked=(), state_of=_exists)
    assert keys.place(parked_row, page, blocked=(), state_of=_exists)
    assert page.held == [Held(later.id, "t", "a", 0)]
    assert not keys.place(_row("b"), page, blocked=(), state_of=_exists)


def test_a_delayed_row_or_a_blocked_topic_parks_its_key_on_the_page() -> None:
    keys = ParkedKeys()
    page = _page()
    delayed = _row("a", delayed=True)
    assert keys.place(delayed, page, blocked=(), state_of=_exists)
    blocked = _row("b", topic="gone")
    denied = {"gone": TopicState.DENIED}
    assert keys.place(
        blocked, page, blocked={"gone"}, state_of=lambda t: denied.get(t, TopicState.EXISTS)
    )
    assert [p.reason for p in page.parked] == ["delayed", "blocked"]
    assert page.parked[1].error == "topic gone is not authorised"
    assert ("t", "a") in keys and keys.any_blocked()
    keys.drop_pages([page])  # the page was dropped: its shard replays
    assert not keys


def test_due_keys_are_asked_for_released_or_their_topic_exists() -> None:
    keys = ParkedKeys()
    keys.add(
        [
            Parking("t", "asked", 0, uuid.uuid4(), "dead", request="requeue"),
            Parking("t", "waiting", 0, uuid.uuid4(), "dead"),
            Parking("t", "later", 1, uuid.uuid4(), "delayed", due=True),
            Parking("gone", "x", 1, uuid.uuid4(), "blocked"),
            Parking("back", "y", 2, uuid.uuid4(), "blocked"),
        ]
    )
    asked: list[str] = []

    def is_blocked(topic: str) -> bool:
        asked.append(topic)
        return topic == "gone"

    due = keys.due(is_blocked)
    assert {s: [p.aggregateid for p in ps] for s, ps in due.items()} == {
        0: ["asked"],
        1: ["later"],
        2: ["y"],
    }
    assert sorted(asked) == ["back", "gone"]


def test_a_refresh_keeps_keys_parked_by_pages_in_flight_and_counts_keys_per_shard() -> None:
    keys = ParkedKeys()
    pending = _page()
    parking = parking_of(_row("a", delayed=True), _exists)
    pending.parked.append(parking)
    stored = Parking("t", "b", 1, uuid.uuid4(), "dead")
    keys.refresh([stored], pending=[pending])
    assert ("t", "a") in keys and ("t", "b") in keys
    assert held_keys([stored], [0, 1]) == {0: 0, 1: 1}
    keys.drop_shard(1)
    assert ("t", "b") not in keys
