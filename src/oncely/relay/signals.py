"""What a relay did, as events a test can wait on instead of polling the database (as River's
producer has test signals): shards taken, lost, handed off, replayed, progress recorded, keys
released. Off unless a :class:`Signals` is given to the relay."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass


class Signal(enum.Enum):
    TOOK = "took"
    LOST = "lost"
    HANDED_OFF = "handed off"
    REPLAYED = "replayed"
    RECORDED = "recorded"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class Event:
    signal: Signal
    shards: frozenset[int]


class Signals:
    """The events of one relay, in order; thread-safe (the relay emits on its loop's thread)."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._changed = threading.Condition()

    def emit(self, signal: Signal, shards: Collection[int]) -> None:
        with self._changed:
            self._events.append(Event(signal, frozenset(shards)))
            self._changed.notify_all()

    def mark(self) -> int:
        """A position in the events: :meth:`wait_for` ``after`` it waits for later ones."""
        with self._changed:
            return len(self._events)

    def events(self, signal: Signal | None = None) -> list[Event]:
        """The events so far (of ``signal`` only, if given)."""
        with self._changed:
            return [e for e in self._events if signal is None or e.signal is signal]

    def wait_for(
        self, signal: Signal, *, shard: int | None = None, after: int = 0, timeout: float
    ) -> Event:
        """The first event ``signal`` (of ``shard``, if given) from position ``after``.

        Raises ``TimeoutError`` when none came within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self._events[after:]:
                    if event.signal is signal and (shard is None or shard in event.shards):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {signal.value} event within {timeout} s")
                self._changed.wait(remaining)
