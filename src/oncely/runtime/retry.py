"""How long to wait before retrying: one exponential backoff for the relay, consumers and tasks."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """The wait before retrying after failed attempt ``n`` (from 1):
    ``min(maximum, first * multiplier ** (n - 1))`` seconds, then scaled by a random factor in
    ``[1 - jitter, 1]``.

    ``first`` is the wait after the first failure, ``maximum`` the longest wait, ``multiplier``
    how much each failure adds, ``jitter`` the fraction that may be taken off at random, so that
    processes failing together do not retry together (0: none).
    """

    first: float
    maximum: float
    multiplier: float = 2.0
    jitter: float = 0.0

    def delay(self, attempt: int, *, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed attempt ``attempt``; ``rand`` draws from ``[0, 1)``."""
        delay = float(min(self.maximum, self.first * self.multiplier ** max(0, attempt - 1)))
        if not self.jitter:
            return delay
        return delay * ((1.0 - self.jitter) + self.jitter * rand())
