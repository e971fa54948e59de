"""Shards shared fairly among the live relays (pure logic): how many one relay should hold, and
which it gives back when it holds more."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Shards to hand off (the highest numbers first) or how many free ones to take."""

    hand_off: tuple[int, ...] = ()
    take: int = 0


def rebalance(holding: Iterable[int], *, shards: int, alive: int) -> Rebalance:
    """What a relay holding ``holding`` (not counting shards already being handed off) does
    when ``alive`` relays share ``shards``: each holds at most ``ceil(shards / alive)``."""
    held = sorted(holding, reverse=True)
    share = math.ceil(shards / max(1, alive))
    if len(held) > share:
        return Rebalance(hand_off=tuple(held[: len(held) - share]))
    return Rebalance(take=share - len(held))
