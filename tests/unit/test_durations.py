"""The one duration grammar and its formatter (:mod:`oncely.durations`), and moments."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from oncely.durations import describe, parse_duration, parse_moment


@pytest.mark.parametrize(
    ("text", "duration"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("1.5h", timedelta(minutes=90)),
        (" 1M ", timedelta(minutes=1)),
        ("6 h", timedelta(hours=6)),
    ],
)
def test_a_duration_is_a_number_and_one_unit(text: str, duration: timedelta) -> None:
    assert parse_duration(text) == duration


@pytest.mark.parametrize("text", ["", "d", "15", "1w", "1h30m", "-5m"])
def test_anything_else_is_refused_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration such as 90s, 15m, 12h or 7d"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("duration", "text"),
    [
        (timedelta(days=1), "1d"),
        (timedelta(hours=6), "6h"),
        (timedelta(minutes=90), "90m"),
        (timedelta(minutes=80), "80m"),
        (timedelta(seconds=45), "45s"),
        (timedelta(days=1000), "1000d"),
        (timedelta(0), "0s"),
        (timedelta(days=2, hours=3, seconds=0.5), "2.13d"),
        (timedelta(hours=5, seconds=0.5), "5h"),
    ],
)
def test_a_duration_is_written_as_the_grammar_reads_it(duration: timedelta, text: str) -> None:
    assert describe(duration) == text


@pytest.mark.parametrize("minutes", [1, 15, 72, 80, 160, 720, 1440, 2880, 10080])
def test_a_whole_duration_reads_back_exactly(minutes: int) -> None:
    step = timedelta(minutes=minutes)
    assert parse_duration(describe(step)) == step


def test_a_moment_is_an_iso_time_or_a_duration_ago() -> None:
    now = datetime(2026, 12, 8, 9, 0, tzinfo=UTC)
    assert parse_moment("15m", now=now) == now - timedelta(minutes=15)
    assert parse_moment("2026-12-08T08:00:00") == datetime(2026, 12, 8, 8, 0, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither an ISO-8601 time"):
        parse_moment("yesterday", now=now)
