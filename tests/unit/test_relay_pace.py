"""The relay's read pace (pure logic): when it polls, when it waits for a NOTIFY, when it reads."""

from __future__ import annotations

from oncely.relay.pace import POLL_MAX, POLL_MIN, WAKE_INTERVAL, Mode, Pace


def _pace() -> Pace:
    return Pace(listen_below=500, poll_above=2000, fallback=10.0, window_start=0.0)


def _listening(pace: Pace, now: float = 1.0) -> None:
    pace.switched(Mode.LISTENING, guard=None)
    pace.read_done(0, complete=True, now=now)


def test_polling_reads_every_turn_and_backs_off_while_nothing_comes() -> None:
    pace = _pace()
    assert pace.mode is Mode.POLLING
    for now in (0.1, 0.2, 0.3):
        assert pace.should_read(now)
        pace.read_done(0, complete=True, now=now)
    assert not pace.listens()
    assert pace.poll == POLL_MAX
    pace.read_done(5, complete=True, now=0.4)
    assert pace.poll == POLL_MIN


def test_a_slow_window_switches_to_listening_and_a_fast_one_back_to_polling() -> None:
    pace = _pace()
    pace.read_done(499, complete=True, now=0.5)
    assert pace.switch(0.9) is None, "the window is not over"
    assert pace.switch(1.0) is Mode.LISTENING
    pace.switched(Mode.LISTENING, guard=None)
    pace.read_done(1999, complete=True, now=1.5)
    assert pace.switch(2.0) is None, "under poll_above: stays listening (hysteresis)"
    pace.read_done(2000, complete=True, now=2.5)
    assert pace.switch(3.0) is Mode.POLLING


def test_a_busy_window_keeps_polling() -> None:
    pace = _pace()
    pace.read_done(600, complete=True, now=0.5)
    assert pace.switch(1.0) is None


def test_listening_reads_only_when_asked_behind_or_after_the_fallback() -> None:
    pace = _pace()
    _listening(pace)
    assert pace.should_read(1.01), "a switch asks for one read"
    pace.read_done(0, complete=True, now=1.01)
    assert pace.listens()
    assert not pace.should_read(1.5)
    pace.ask()
    assert pace.should_read(1.6)
    pace.read_done(0, complete=True, now=1.6)
    assert not pace.should_read(1.7), "a read clears the request"
    assert pace.should_read(11.7), "the fallback reads anyway"


def test_reads_asked_for_by_notifies_are_at_least_the_wake_interval_apart() -> None:
    pace = _pace()
    _listening(pace)
    pace.should_read(1.0)
    pace.read_done(1, complete=True, now=1.0)
    pace.ask()
    assert not pace.should_read(1.0 + WAKE_INTERVAL / 2)
    assert not pace.listens(), "it waits on the producer, not for another NOTIFY"
    assert pace.should_read(1.0 + WAKE_INTERVAL)


def test_listening_keeps_reading_while_a_read_left_rows_behind() -> None:
    pace = _pace()
    _listening(pace)
    pace.should_read(1.0)
    pace.read_done(1000, complete=False, now=1.0)
    assert not pace.listens()
    assert pace.should_read(1.1)
    pace.read_done(10, complete=True, now=1.1)
    assert pace.listens()
    assert not pace.should_read(1.2)


def test_the_guard_keeps_reading_until_the_transactions_running_at_the_switch_end() -> None:
    pace = _pace()
    pace.switched(Mode.LISTENING, guard=100)
    pace.read_done(0, complete=True, now=1.0)
    assert not pace.listens()
    assert pace.should_read(1.1)
    pace.guard_passed(99)
    assert pace.should_read(1.2), "a transaction running at the switch may not notify"
    pace.guard_passed(100)
    pace.read_done(0, complete=True, now=1.3)
    assert pace.listens()
    assert not pace.should_read(1.4)


def test_switching_back_to_polling_drops_the_guard() -> None:
    pace = _pace()
    pace.switched(Mode.LISTENING, guard=100)
    pace.switched(Mode.POLLING)
    assert pace.guard is None
