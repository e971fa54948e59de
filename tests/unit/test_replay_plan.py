"""What a planned offset move re-reads, and what it would skip."""

from __future__ import annotations

from oncely.consumers.replay import PartitionMove


def test_moving_back_rereads_and_skips_nothing() -> None:
    move = PartitionMove("t", 0, current=120, target=20, high=130)
    assert (move.to_reread, move.skips) == (100, 0)


def test_a_group_that_never_committed_rereads_up_to_the_high_watermark() -> None:
    move = PartitionMove("t", 0, current=None, target=0, high=50)
    assert (move.to_reread, move.skips) == (50, 0)


def test_moving_forward_past_unread_records_is_a_skip() -> None:
    move = PartitionMove("t", 1, current=10, target=40, high=50)
    assert (move.to_reread, move.skips) == (0, 30)
