"""The read pace's switches: listening marks the relay asleep and keeps a guard until the
transactions running at the switch have ended; a failed switch leaves the pace as it was."""

from __future__ import annotations

from oncely.relay import listening
from oncely.relay.pace import Mode, Pace
from tests.unit.relay_fakes import FakeStore, guard


class _Wakeup:
    def __init__(self) -> None:
        self.listening = False

    def listen(self) -> None:
        self.listening = True

    def unlisten(self) -> None:
        self.listening = False


def _quiet_pace() -> Pace:
    return Pace(listen_below=500, poll_above=2000, fallback=10.0, window_start=0.0)


def test_a_quiet_relay_listens_asleep_and_guards_until_running_transactions_end() -> None:
    store, wakeup, pace = FakeStore(), _Wakeup(), _quiet_pace()
    store.stage(0, "k")
    listening.switch(pace, store, wakeup, now=2.0, db=guard)
    assert pace.mode is Mode.LISTENING and wakeup.listening and store.asleep
    assert pace.guard == store.snapshot()[0].xmax
    listening.check_guard(pace, store, db=guard)
    assert pace.guard is None


def test_a_failed_switch_leaves_the_pace_polling_and_is_tried_again() -> None:
    store, wakeup, pace = FakeStore(), _Wakeup(), _quiet_pace()
    store.fail["sleep"] = 1
    listening.switch(pace, store, wakeup, now=2.0, db=guard)
    assert pace.mode is Mode.POLLING and not store.asleep
    listening.switch(pace, store, wakeup, now=4.0, db=guard)
    assert pace.mode is Mode.LISTENING and store.asleep


def test_without_a_wakeup_a_relay_never_listens() -> None:
    store, pace = FakeStore(), _quiet_pace()
    listening.switch(pace, store, None, now=2.0, db=guard)
    assert pace.mode is Mode.POLLING and not store.asleep
