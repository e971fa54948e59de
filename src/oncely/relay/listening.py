"""What the read pace's switches do (:mod:`oncely.relay.pace` decides when): listening for
NOTIFYs with the relay marked asleep, or polling with neither; and the snapshot that tells a
relay that just began listening when the transactions running at the switch have ended (their
commits sent no NOTIFY). Calls the database through the loop's guard.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

from oncely.relay.pace import Mode, Pace
from oncely.relay.ports import FAILED, Guard, RelayStore

log = logging.getLogger(__name__)


class Listener(Protocol):
    """The NOTIFY channel (:class:`oncely.runtime.wakeup.Wakeup`)."""

    def listen(self) -> None: ...

    def unlisten(self) -> None: ...


def switch(
    pace: Pace, store: RelayStore, wakeup: Listener | None, *, now: float, db: Guard
) -> None:
    """Switch between polling and listening when the rate of rows read asks for it (never to
    listening without a ``wakeup``); a failed switch is tried again on a later turn."""
    mode = pace.switch(now)
    if mode is None or (mode is Mode.LISTENING and wakeup is None):
        return
    guard = db(f"switch to {mode.value}", functools.partial(_mark, store, wakeup, mode))
    if guard is not FAILED:
        pace.switched(mode, guard=guard)
        log.debug("relay %s", mode.value)


def check_guard(pace: Pace, store: RelayStore, *, db: Guard) -> None:
    """Listening since a moment ago: have the transactions running then ended?"""
    taken = db("snapshot", store.snapshot)
    if taken is not FAILED:
        pace.guard_passed(taken[0].xmin)


def _mark(store: RelayStore, wakeup: Listener | None, mode: Mode) -> int | None:
    """Listen for NOTIFYs and mark the relay asleep (or neither); listening: the xmax of a
    snapshot taken after the mark was committed."""
    listening = mode is Mode.LISTENING
    if wakeup is not None:
        if listening:
            wakeup.listen()
        else:
            wakeup.unlisten()
    store.sleep(asleep=listening)
    return store.snapshot()[0].xmax if listening else None
