"""Where a relay's page ends, and how shards are shared (pure logic of the relay loop)."""

from __future__ import annotations

import uuid

from oncely.relay.extent import Extent, extent, first_suspect
from oncely.relay.leases import Rebalance, rebalance
from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

DONE = Snapshot(10, 12, frozenset())
READING = Snapshot(20, 25, frozenset())
CURSOR = Progress(DONE)


def _row(seq: int, *, shard: int = 0, topic: str = "t", payload: bytes = b"x") -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), seq, shard, topic, f"k{seq}", "e", payload, (), 0)


def _suspect(rows: list[OutboxRow], **kwargs: object) -> int | None:
    values: dict[str, object] = {
        "waiting": lambda row: False,
        "suspects": set(),
        "limit_of": lambda topic: None,
        **kwargs,
    }
    return first_suspect(rows, **values)  # type: ignore[arg-type]


def test_a_short_read_ends_at_its_snapshot_and_a_full_one_at_its_last_row() -> None:
    rows = [_row(1), _row(2)]
    short = extent(rows, cursor=CURSOR, reading=READING, page_size=3, suspect=None, busy=bool)
    assert short == Extent(rows, Progress(READING))
    full = extent(rows, cursor=CURSOR, reading=READING, page_size=2, suspect=None, busy=bool)
    assert full == Extent(rows, Progress(DONE, READING, 2))


def test_rows_before_a_suspect_go_out_and_the_read_ends_before_it() -> None:
    rows = [_row(1), _row(2), _row(3)]
    cut = extent(rows, cursor=CURSOR, reading=READING, page_size=3, suspect=2, busy=bool)
    assert cut == Extent(rows[:2], Progress(DONE, READING, 2))


def test_a_suspect_first_goes_alone_once_its_shard_has_nothing_in_flight() -> None:
    rows = [_row(7, shard=3), _row(8, shard=4)]
    waits = extent(
        rows, cursor=CURSOR, reading=READING, page_size=5, suspect=0, busy=lambda s: True
    )
    assert waits is None
    alone = extent(
        rows, cursor=CURSOR, reading=READING, page_size=5, suspect=0, busy=lambda s: False
    )
    assert alone == Extent([rows[0]], Progress(DONE, READING, 7), alone=3)


def test_suspects_are_rows_that_failed_or_exceed_their_topics_limit() -> None:
    rows = [_row(1), _row(2, payload=b"x" * 500), _row(3)]
    assert _suspect(rows) is None
    assert _suspect(rows, limit_of=lambda topic: 400) == 1
    assert _suspect(rows, suspects={rows[0].id}) == 0
    waiting = {rows[1].event_id}
    assert _suspect(rows, limit_of=lambda t: 400, waiting=lambda r: r.event_id in waiting) is None


def test_each_topic_limit_is_asked_once_per_read() -> None:
    asked: list[str] = []

    def limit_of(topic: str) -> int | None:
        asked.append(topic)
        return None

    assert _suspect([_row(1), _row(2), _row(3, topic="u")], limit_of=limit_of) is None
    assert asked == ["t", "u"]


def test_a_relay_takes_its_share_and_hands_off_the_highest_shards_over_it() -> None:
    assert rebalance([], shards=32, alive=1) == Rebalance(take=32)
    assert rebalance(range(32), shards=32, alive=3) == Rebalance(hand_off=tuple(range(31, 10, -1)))
    assert rebalance(range(10), shards=32, alive=3) == Rebalance(take=1)
    assert rebalance(range(11), shards=32, alive=3) == Rebalance()
    assert rebalance([], shards=4, alive=0) == Rebalance(take=4), "alone even before its beat"
