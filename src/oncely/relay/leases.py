"""Which shards a relay keeps, gives back and takes at each heartbeat (pure logic): the shards
are shared fairly among the live relays, each holding at most ``ceil(shards / alive)``."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rebalance:
    """Shards to hand off (the highest numbers first) or how many free ones to take."""

    hand_off: tuple[int, ...] = ()
    take: int = 0


@dataclass(frozen=True, slots=True)
class LeasePlan:
    """What a heartbeat's answer asks of a relay: forget the shards ``lost`` to another relay,
    hand off ``hand_off`` (over its share) and take ``take`` free or expired shards."""

    lost: tuple[int, ...] = ()
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


def plan_tick(
    held: Collection[int],
    *,
    handing_off: Collection[int],
    kept: Collection[int],
    shards: int,
    alive: int,
) -> LeasePlan:
    """The plan for a relay holding ``held`` (of which ``handing_off`` are being given back)
    when its heartbeat renewed ``kept`` and ``alive`` relays share ``shards``."""
    lost = tuple(sorted(number for number in held if number not in kept))
    share = rebalance(
        (n for n in held if n in kept and n not in handing_off), shards=shards, alive=alive
    )
    return LeasePlan(lost=lost, hand_off=share.hand_off, take=share.take)
