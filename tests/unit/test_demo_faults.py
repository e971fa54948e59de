"""The demo's fault windows and its figures inside and outside them (pure logic)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from examples.payments.faults import (
    Fault,
    Trip,
    Window,
    covered_seconds,
    figures,
    report,
    windows,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def trip(committed: float, applied: float) -> Trip:
    return Trip(at(committed), at(applied))


def test_a_window_ends_when_the_last_event_committed_before_the_process_was_back_is_applied() -> (
    None
):
    trips = [trip(1, 1.1), trip(4.9, 9.0), trip(5.5, 9.2), trip(7, 7.1)]
    [window] = windows([Fault("relay", started=at(2), back=at(5))], trips)
    # 4.9 was committed before the relay was back: its effect (9.0) closes the window; 5.5,
    # committed after, does not extend it.
    assert (window.start, window.end) == (at(2), at(9.0))


def test_a_window_never_ends_before_the_process_was_back() -> None:
    [window] = windows([Fault("crash", started=at(2), back=at(5))], [trip(1, 1.1)])
    assert window.end == at(5)


def test_an_observed_catch_up_ends_the_window() -> None:
    fault = Fault("replay", started=at(10), back=at(11), caught_up=at(14))
    [window] = windows([fault], [trip(1, 20)])
    assert window.end == at(14)


def test_a_process_never_seen_back_leaves_the_window_open_to_the_last_effect() -> None:
    [window] = windows([Fault("relay", started=at(2))], [trip(1, 1.5), trip(3, 8)])
    assert window.end == at(8)
    [empty] = windows([Fault("relay", started=at(2))], [])
    assert empty.end == at(2)


def test_an_event_is_inside_when_committed_in_the_window_or_in_flight_when_it_opened() -> None:
    window = Window("relay", at(2), at(6))
    assert window.holds(trip(1.5, 2.5)), "in flight when the fault began"
    assert window.holds(trip(3, 7)), "committed in the window"
    assert window.holds(trip(6, 6.1)), "committed at its end"
    assert not window.holds(trip(1, 1.9)), "applied before the fault"
    assert not window.holds(trip(6.5, 6.6)), "committed after the catch-up"


def test_covered_seconds_counts_overlaps_once_and_only_inside_the_span() -> None:
    found = [Window("a", at(2), at(5)), Window("b", at(4), at(7)), Window("c", at(9), at(30))]
    assert covered_seconds((at(0), at(10)), found) == pytest.approx(5 + 1)
    assert covered_seconds((at(0), at(1)), found) == 0
    assert covered_seconds((at(3), at(4)), found) == pytest.approx(1)


def test_percentiles_interpolate_as_percentile_cont() -> None:
    trips = [trip(0, ms / 1000) for ms in range(1, 101)]
    result = figures(trips, seconds=4)
    # percentile_cont(0.5) and (0.99) over 1..100: 50.5 and 99.01.
    assert result.p50_ms == pytest.approx(50.5)
    assert result.p99_ms == pytest.approx(99.01)
    assert result.per_second == 25
    single = figures([trip(0, 0.25)], seconds=1)
    assert (single.p50_ms, single.p99_ms) == (pytest.approx(250), pytest.approx(250))
    none = figures([], seconds=0)
    assert (none.events, none.p50_ms, none.per_second) == (0, None, None)


def test_the_report_splits_events_and_time_at_the_windows() -> None:
    trips = [
        trip(0, 0.1),  # outside
        trip(1, 1.2),  # outside
        trip(1.9, 6.0),  # in flight when the relay died: inside
        trip(3, 6.1),  # committed while the relay was down: inside
        trip(8, 8.3),  # outside
        trip(9, 10),  # outside
    ]
    faults = [
        Fault("relay", started=at(2), back=at(4)),
        Fault("replay", started=at(20), back=at(21), caught_up=at(25)),
    ]
    result = report(faults, trips)
    assert result.overall.events == 6
    assert result.overall.seconds == pytest.approx(10)
    # The relay's window is 2 s .. 6.1 s (3 s committed before it was back, applied at 6.1);
    # the replay's lies after the run's last effect and takes no time from it.
    assert [(w.start, w.end) for w, _ in result.windows] == [(at(2), at(6.1)), (at(20), at(25))]
    assert [len(inside) for _, inside in result.windows] == [2, 0]
    assert result.inside == 2
    assert result.outside.events == 4
    assert result.outside.seconds == pytest.approx(10 - 4.1)
    assert result.outside.p99_ms is not None and result.outside.p99_ms < 1000
    assert result.overall.p99_ms is not None and result.overall.p99_ms > 3000


def test_without_faults_the_outside_figures_are_the_overall_ones() -> None:
    trips = [trip(0, 0.1), trip(1, 1.3)]
    result = report([], trips)
    assert result.outside == result.overall
    assert result.inside == 0 and result.windows == []
