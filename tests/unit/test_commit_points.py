"""The offset tracker: a partition commits the contiguous prefix its lanes have finished."""

from __future__ import annotations

from oncely.consumers.commit_points import OffsetTracker

TP = ("t", 0)


def test_a_partition_commits_only_its_contiguous_finished_prefix() -> None:
    tracker = OffsetTracker()
    generation = tracker.register(TP, [10, 11, 12, 13, 14])
    tracker.finish(TP, [12, 13, 14], generation)  # other lanes went ahead of 10 and 11
    assert tracker.commit_points() == {TP: 10}, "not past the lowest unfinished record"
    tracker.finish(TP, [10], generation)
    assert tracker.commit_points() == {TP: 11}
    tracker.finish(TP, [11], generation)
    assert tracker.commit_points() == {TP: 15}
    assert tracker.commit_points() == {}, "only points that moved are handed out"
    assert len(tracker) == 0


def test_the_commit_point_follows_records_registered_later() -> None:
    tracker = OffsetTracker()
    first = tracker.register(TP, [0, 1])
    tracker.finish(TP, [0, 1], first)
    second = tracker.register(TP, [2, 3])
    assert tracker.commit_point(TP) == 2
    tracker.finish(TP, [3], second)
    assert tracker.commit_point(TP) == 2
    tracker.finish(TP, [2], second)
    assert tracker.commit_point(TP) == 4


def test_partitions_are_independent() -> None:
    tracker = OffsetTracker()
    slow = tracker.register(("t", 1), [5, 6])
    fast = tracker.register(TP, [7, 8])
    tracker.finish(TP, [7, 8], fast)
    tracker.finish(("t", 1), [6], slow)
    assert tracker.commit_points() == {TP: 9, ("t", 1): 5}


def test_a_reset_drops_the_records_from_the_failed_one_and_ignores_their_old_copies() -> None:
    tracker = OffsetTracker()
    old = tracker.register(TP, [0, 1, 2, 3, 4])
    tracker.finish(TP, [0], old)
    assert tracker.is_current(TP, 2, old)
    tracker.reset(TP, 2)  # offset 2 failed: read again from it
    assert not tracker.is_current(TP, 2, old), "its failure is acted on once"
    assert tracker.commit_point(TP) == 1, "offset 1 is still applying in another lane"
    tracker.finish(TP, [3, 4], old)  # another lane applied old copies: they finish nothing
    tracker.finish(TP, [1], old)
    assert tracker.commit_point(TP) == 2
    new = tracker.register(TP, [2, 3, 4])
    assert new != old
    tracker.finish(TP, [2, 3], old)
    assert tracker.commit_point(TP) == 2, "an old copy does not finish the new one"
    tracker.finish(TP, [2, 3, 4], new)
    assert tracker.commit_point(TP) == 5


def test_a_lower_failure_reported_after_a_reset_is_still_acted_on() -> None:
    tracker = OffsetTracker()
    generation = tracker.register(TP, list(range(10)))
    tracker.reset(TP, 7)  # one lane failed at 7 ...
    assert tracker.is_current(TP, 3, generation), "... another at 3, reported later"
    tracker.reset(TP, 3)
    assert tracker.commit_point(TP) == 0
    tracker.finish(TP, [0, 1, 2], generation)
    assert tracker.commit_point(TP) == 3


def test_a_dead_letter_moves_the_point_past_it_only_when_all_below_is_finished() -> None:
    tracker = OffsetTracker()
    generation = tracker.register(TP, [0, 1, 2, 3])
    tracker.reset(TP, 2)  # 2 failed and is dead-lettered while 1 is still applying
    tracker.skip_to(TP, 3)
    assert tracker.commit_point(TP) == 0
    tracker.finish(TP, [0, 1], generation)
    assert tracker.commit_point(TP) == 3
    after = tracker.register(TP, [3, 4])
    tracker.finish(TP, [3, 4], after)
    assert tracker.commit_point(TP) == 5


def test_forgotten_partitions_commit_nothing_and_ignore_late_reports() -> None:
    tracker = OffsetTracker()
    generation = tracker.register(TP, [0, 1])
    tracker.forget([TP])
    tracker.finish(TP, [0, 1], generation)
    assert tracker.commit_points() == {}
    assert tracker.pending_in([TP]) == 0
    again = tracker.register(TP, [0, 1])
    assert again > generation
    never = ("t", 9)
    tracker.forget([never])  # revoked before anything of it was handed out
    assert tracker.generation(never) == 1, "one on, as for any partition let go"
    tracker.finish(TP, [0, 1], generation)
    assert tracker.commit_point(TP) == 0
