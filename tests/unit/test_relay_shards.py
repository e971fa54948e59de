"""A shard's phase: one setter that logs each move and refuses an illegal one; the table reads
only shards reading, and hands off, backs off and releases through it."""

from __future__ import annotations

import logging

import pytest

from oncely.relay.shards import InFlight, Page, Phase, Shard, ShardTable
from oncely.runtime.retry import Backoff
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.snapshots import Snapshot

START = Progress(Snapshot(1, 1, frozenset()))


def _table(*numbers: int) -> ShardTable:
    table = ShardTable(Backoff(first=1.0, maximum=8.0))
    for number in numbers:
        table.take(ShardProgress(number, 1, START), lease_deadline=100.0)
    return table


def _readable(table: ShardTable, now: float = 0.0) -> set[int]:
    return {s.shard for members in table.groups(now=now, margin=3.0).values() for s in members}


def test_a_shard_handing_off_never_reads_again(caplog: pytest.LogCaptureFixture) -> None:
    table = _table(0, 1)
    table.hand_off((1,))
    shard = table.get(1)
    assert shard is not None and shard.phase is Phase.HANDING_OFF
    with caplog.at_level(logging.DEBUG, logger="oncely.relay.shards"):
        for phase in (Phase.READING, Phase.ALONE, Phase.BACKING_OFF, Phase.RELEASING):
            assert not shard.enter(phase)
    assert shard.phase is Phase.HANDING_OFF
    assert "shard 1 stays handing off (not reading)" in caplog.text
    table.wake(1e9)
    table.releasing(frozenset({1}))
    table.reset(shard, backoff=True, now=0.0)
    assert shard.phase is Phase.HANDING_OFF
    assert _readable(table) == {0}
    assert [s.shard for s in table.ready_to_hand_off()] == [1]


def test_each_move_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    shard = Shard(3, 1, START, START, 100.0)
    with caplog.at_level(logging.DEBUG, logger="oncely.relay.shards"):
        assert shard.enter(Phase.RELEASING)
        assert shard.enter(Phase.RELEASING)  # already there: no move
    assert caplog.messages == ["shard 3: reading -> releasing"]


def test_backing_off_reads_again_only_after_its_retry_time_and_never_straight_into_releasing() -> (
    None
):
    table = _table(0)
    shard = table.get(0)
    assert shard is not None
    table.reset(shard, backoff=True, now=10.0)
    assert shard.phase is Phase.BACKING_OFF and 10.5 <= shard.retry_at <= 11.0
    assert not shard.enter(Phase.RELEASING)
    table.releasing(frozenset({0}))
    assert shard.phase is Phase.BACKING_OFF
    table.wake(10.2)
    assert _readable(table) == set()
    table.wake(shard.retry_at)
    assert _readable(table) == {0}
    table.reset(shard, backoff=True, now=20.0)
    assert shard.attempts == 2  # the backoff grows until progress is recorded
    table.recorded(ShardProgress(0, 1, START))
    assert shard.attempts == 0


def test_an_isolated_page_keeps_its_shard_alone_until_it_settles() -> None:
    table = _table(0)
    shard = table.get(0)
    assert shard is not None
    page = Page(0, START, table.in_flight, isolated=True)
    page.outstanding = 1
    shard.add(page)
    assert shard.phase is Phase.ALONE and _readable(table) == set()
    assert shard.take_acknowledged() == []
    page.outstanding = 0
    assert shard.take_acknowledged() == [page]
    assert shard.phase is Phase.READING and _readable(table) == {0}


def test_due_keys_stop_reading_until_released() -> None:
    table = _table(0, 1)
    table.releasing(frozenset({0}))
    assert _readable(table) == {1}
    table.releasing(frozenset())
    assert _readable(table) == {0, 1}


def test_a_lease_near_its_end_is_not_read_and_groups_follow_the_cursor() -> None:
    table = _table(0, 1, 2)
    moved = Progress(Snapshot(5, 5, frozenset()))
    shard = table.get(2)
    assert shard is not None
    shard.cursor = moved
    groups = table.groups(now=0.0, margin=3.0)
    assert {k: [s.shard for s in v] for k, v in groups.items()} == {START: [0, 1], moved: [2]}
    assert _readable(table, now=97.5) == set()


def test_dropping_a_shard_abandons_its_pages() -> None:
    table = _table(0)
    in_flight: InFlight = table.in_flight
    shard = table.get(0)
    assert shard is not None
    page = Page(0, START, in_flight)
    page.outstanding, in_flight.count = 2, 2
    shard.add(page)
    table.drop(0)
    assert in_flight.count == 0 and 0 not in table
    page.report(None, None)  # a late report of an abandoned page counts nothing
    assert in_flight.count == 0
