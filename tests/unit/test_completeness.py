"""Completeness's bucket arithmetic: the window, its buckets as id ranges, which buckets are read
event by event."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

import pytest

from oncely.consumers.completeness import (
    EffectCompleteness,
    bucket_edges,
    disagreeing,
    window,
)
from oncely.ids import lowest_of_millis, millis_of, uuid7
from oncely.settings import CompletenessSettings
from oncely.storage.stores.receipts import BucketCounts, CompletenessBounds

pytestmark = pytest.mark.unit

MINUTE = 60_000
NOW = 1_800_000_000_000 + 30_000  # half a minute past a minute
SETTINGS = CompletenessSettings(grace_seconds=300, bucket_seconds=60, window_seconds=3600)


def test_a_bucket_edge_is_the_lowest_uuid7_of_its_millisecond() -> None:
    event_id = uuid7()
    ms = millis_of(event_id)
    assert lowest_of_millis(ms) <= event_id < lowest_of_millis(ms + 1)
    assert millis_of(lowest_of_millis(ms)) == ms
    assert lowest_of_millis(0) == UUID(int=0)


def test_the_window_ends_at_the_last_closed_bucket_before_the_grace_period() -> None:
    span = window(CompletenessBounds(lowest_of_millis(NOW - 7200_000), NOW), SETTINGS)
    assert span == (NOW - 3600_000, NOW - 30_000 - 5 * MINUTE)


def test_the_window_starts_at_the_oldest_kept_row_when_it_is_later() -> None:
    oldest = NOW - 20 * MINUTE + 123
    span = window(CompletenessBounds(lowest_of_millis(oldest), NOW), SETTINGS)
    assert span == (oldest, NOW - 30_000 - 5 * MINUTE)


@pytest.mark.parametrize("oldest", [None, lowest_of_millis(NOW - 5 * MINUTE)])
def test_nothing_is_checked_in_an_empty_outbox_or_within_the_grace_period(
    oldest: UUID | None,
) -> None:
    assert window(CompletenessBounds(oldest, NOW), SETTINGS) is None


def test_buckets_cover_the_window_on_multiples_of_their_width() -> None:
    assert bucket_edges(90, 300, 100) == [90, 100, 200, 300]
    assert bucket_edges(100, 300, 100) == [100, 200, 300]
    assert bucket_edges(10, 50, 100) == [10, 50]


def test_a_bucket_is_read_event_by_event_when_its_count_or_its_hash_sum_disagrees() -> None:
    counts = [
        BucketCounts(events=3, events_hash=10, done=3, done_hash=10),  # agrees
        BucketCounts(events=3, events_hash=10, done=2, done_hash=7),  # one not applied
        BucketCounts(events=3, events_hash=10, done=3, done_hash=11),  # another event's receipt
        BucketCounts(events=0, events_hash=0, done=1, done_hash=4),  # a receipt of a purged row
        BucketCounts(events=0, events_hash=0, done=0, done_hash=0),
    ]
    assert disagreeing(counts) == [1, 2, 3]


def test_the_json_of_an_effect_s_completeness() -> None:
    event_id = uuid7()
    moment = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    checked = EffectCompleteness("ledger", 1, moment, moment, moment, [event_id], 60, 1)
    assert checked.to_json() == {
        "effect": "ledger",
        "missing": 1,
        "oldest_missing_at": "2026-12-01T12:00:00+00:00",
        "window_start": "2026-12-01T12:00:00+00:00",
        "window_end": "2026-12-01T12:00:00+00:00",
        "sample_ids": [str(event_id)],
        "buckets": 60,
        "buckets_read": 1,
    }
