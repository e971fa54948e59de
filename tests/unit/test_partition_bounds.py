"""Partition bounds from time: UUIDv7 bounds, epoch-aligned steps, names, and the steps a user
may choose."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from oncely import ids
from oncely.errors import ConfigurationError
from oncely.ids import uuid7
from oncely.storage import partitions


def test_a_uuid7_falls_in_the_range_of_the_step_it_was_made_in() -> None:
    step = timedelta(minutes=15)
    before = datetime.now(UTC)
    event_id = uuid7()
    start = partitions.window_start(ids.moment_of(event_id), step)
    assert ids.lowest_of(start) <= event_id < ids.lowest_of(start + step)
    assert abs(ids.moment_of(event_id) - before) < timedelta(seconds=5)


def test_bounds_are_the_lowest_uuid_of_their_millisecond() -> None:
    moment = datetime(2026, 12, 6, 7, 0, 0, 123000, tzinfo=UTC)
    bound = ids.lowest_of(moment)
    assert str(bound) == f"{int(moment.timestamp() * 1000):012x}"[:8] + "-" + (
        f"{int(moment.timestamp() * 1000):012x}"[8:] + "-0000-0000-000000000000"
    )
    assert ids.moment_of(bound) == moment


def test_steps_align_to_the_epoch_and_name_their_partitions_by_their_start() -> None:
    moment = datetime(2026, 12, 6, 7, 44, 59, tzinfo=UTC)
    assert partitions.window_start(moment, timedelta(days=1)) == datetime(2026, 12, 6, tzinfo=UTC)
    start = partitions.window_start(moment, timedelta(minutes=15))
    assert start == datetime(2026, 12, 6, 7, 30, tzinfo=UTC)
    assert partitions.partition_name("oncely_outbox", start) == "oncely_outbox_p20261206t073000"


@pytest.mark.parametrize(
    ("text", "step"),
    [
        ("1d", timedelta(days=1)),
        ("6h", timedelta(hours=6)),
        ("15m", timedelta(minutes=15)),
        ("2d", timedelta(days=2)),
        (" 1M ", timedelta(minutes=1)),
    ],
)
def test_steps_a_user_may_choose(text: str, step: timedelta) -> None:
    assert partitions.parse_step(text) == step


@pytest.mark.parametrize("text", ["", "0m", "7m", "5h", "1w", "1.5d", "d", "30s"])
def test_a_step_that_does_not_tile_a_day_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ConfigurationError, match="give minutes, hours or days") as error:
        partitions.parse_step(text)
    assert "\n" not in str(error.value)


def test_only_range_partitions_oncely_created_are_dropped() -> None:
    default = partitions.Partition("oncely_outbox", "oncely_outbox_default", None, None, 0)
    with pytest.raises(ValueError, match="only a range partition"):
        partitions.drop(None, default, timeout=1)  # type: ignore[arg-type]  # no SQL is run
