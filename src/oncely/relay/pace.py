"""When the relay reads: polling while rows flow fast, waiting for a NOTIFY while they do not.

Two modes, switched on the rows read per second (with hysteresis, so a steady rate does not
flip them):

- **polling** (busy): read every turn, waiting ``POLL_MIN`` after rows and up to
  ``POLL_MAX`` while none come. Staging sends no NOTIFY (its commits take no notification
  lock) because no relay is marked asleep. A relay starts here and stays while it reads at
  least ``listen_below`` rows/s.
- **listening** (quiet): the relay is marked asleep, so every staging statement NOTIFYs at
  commit; it reads only when one arrived, when its last read did not reach the end of what was
  committed (a full page, rows left behind a suspect, the in-flight bound), or every
  ``fallback`` seconds; reads a NOTIFY asks for are at least :data:`WAKE_INTERVAL` apart. It
  goes back to polling once it reads ``poll_above`` rows/s.

A writer whose statement ran before the relay was marked asleep does not NOTIFY: right after
the switch the relay reads every turn until every transaction running then has ended
(:meth:`Pace.guard_until`).

Pure logic: the loop tells it what happened and asks what to do, with its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

#: Rows read per second under which the relay waits for NOTIFYs, and from which it polls again:
#: a NOTIFY per commit costs writers a global lock at commit.
LISTEN_BELOW, POLL_ABOVE = 500.0, 2000.0
#: Poll intervals while polling: the first after rows were read, doubling up to the last.
POLL_MIN, POLL_MAX = 0.001, 0.004
#: Rows per second are counted over windows this long.
WINDOW = 1.0
#: While listening, reads asked for by NOTIFYs are at least this far apart (seconds).
WAKE_INTERVAL = 0.002


class Mode(Enum):
    POLLING = "polling"
    LISTENING = "listening"


@dataclass
class Pace:
    """The read pace of one relay: its mode, and whether the next turn reads."""

    listen_below: float
    poll_above: float
    fallback: float
    mode: Mode = Mode.POLLING
    #: Rows read in the current window, and when it started.
    window_rows: int = 0
    window_start: float = 0.0
    #: The last read reached the end of what was committed when it was taken.
    caught_up: bool = False
    #: A notification (or a change of the relay's own state) asks for a read.
    asked: bool = True
    #: While set: the xmax of a snapshot taken after the switch to listening; read every turn
    #: until a snapshot's xmin reaches it.
    guard: int | None = None
    last_read: float = 0.0
    poll: float = POLL_MIN

    def read_done(self, rows: int, *, complete: bool, now: float) -> None:
        """A read returned ``rows``; ``complete``: it reached the end of its snapshot."""
        self.window_rows += rows
        self.caught_up = complete
        self.last_read = now
        self.poll = POLL_MIN if rows else min(POLL_MAX, self.poll * 2)

    def ask(self) -> None:
        """Read on the next turn (a NOTIFY arrived, shards were taken or replay)."""
        self.asked = True

    def should_read(self, now: float) -> bool:
        """Whether this turn reads; a read clears the request. While listening, reads asked for
        by NOTIFYs are at least ``WAKE_INTERVAL`` apart: a relay woken by every commit of a
        busy database (another relay's shards) reads no more often than a polling one."""
        since = now - self.last_read
        if (
            self.mode is Mode.POLLING
            or not self.caught_up
            or self.guard is not None
            or (self.asked and since >= WAKE_INTERVAL)
            or since >= self.fallback
        ):
            self.asked = False
            return True
        return False

    def switch(self, now: float) -> Mode | None:
        """At the end of each window: the mode to switch to, or ``None`` to stay."""
        if now - self.window_start < WINDOW:
            return None
        rate = self.window_rows / (now - self.window_start)
        self.window_rows, self.window_start = 0, now
        if self.mode is Mode.POLLING and rate < self.listen_below:
            return Mode.LISTENING
        if self.mode is Mode.LISTENING and rate >= self.poll_above:
            return Mode.POLLING
        return None

    def switched(self, mode: Mode, *, guard: int | None = None) -> None:
        """The relay is now marked ``mode`` (asleep when listening); ``guard``: the xmax of a
        snapshot taken after the mark was committed."""
        self.mode = mode
        self.guard = guard if mode is Mode.LISTENING else None
        self.asked = True

    def guard_passed(self, xmin: int) -> None:
        """A snapshot with ``xmin`` was taken: the transactions running at the switch ended
        once it reaches the guard."""
        if self.guard is not None and xmin >= self.guard:
            self.guard = None

    def listens(self) -> bool:
        """Whether a turn that read nothing new waits for a NOTIFY (else it polls the
        producer for :attr:`poll` seconds): listening, past the guard, nothing left to read."""
        return (
            self.mode is Mode.LISTENING and self.guard is None and self.caught_up and not self.asked
        )
