"""Bookkeeping of an effect consumer's place in its group: what it holds, and since when not.

Pure logic, fed by the rebalance callbacks and read by the poll loop and ``/readyz``; times are
``time.monotonic()`` seconds passed in by the caller.

Two facts are kept apart:

- **holding partitions**: the consumer has some assigned. Without any for longer than
  ``bound`` seconds it is not ready (``/readyz`` answers 503): it does no work, whether its
  group has more members than partitions or it is out of the group.
- **in the group**: an assign callback (even an empty one) came after the consumer started or
  after it last lost its assignment. A consumer out of the group, without partitions, for longer
  than ``bound`` is :meth:`Membership.stranded`: its client is not rejoining by itself and must
  be recreated.
  A member that the group gave nothing is in the group, and recreating it would not help.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from oncely.consumers.apply import PartitionId


@dataclass
class Membership:
    """Where one consumer stands in its group (see the module docstring)."""

    bound: float
    started: float
    partitions: set[PartitionId] = field(default_factory=set)
    in_group: bool = False
    joined_once: bool = False
    #: When the consumer last went from some partitions to none (or started).
    empty_since: float | None = None
    #: When the current client started to (re)join: the start, or the last :meth:`restarted`.
    joining_since: float | None = None

    def __post_init__(self) -> None:
        if self.empty_since is None:
            self.empty_since = self.started
        if self.joining_since is None:
            self.joining_since = self.started

    def assigned(self, partitions: Iterable[PartitionId], now: float) -> None:
        """The group gave these partitions (possibly none): the consumer is in the group."""
        self.in_group = True
        self.joined_once = True
        self.partitions.update(partitions)
        if self.partitions:
            self.empty_since = None

    def revoked(self, partitions: Iterable[PartitionId], now: float, *, lost: bool) -> None:
        """These partitions were taken away; ``lost`` when the group dropped the consumer."""
        had = bool(self.partitions)
        self.partitions.difference_update(partitions)
        if lost:
            self.in_group = False
        if had and not self.partitions:
            self.empty_since = now

    def restarted(self, now: float) -> None:
        """The client was recreated: it holds nothing and is not in the group yet. It gets
        ``bound`` seconds to join before it counts as stranded again; readiness still counts
        from when the last partition left."""
        self.partitions.clear()
        self.in_group = False
        self.joining_since = now

    def unassigned_for(self, now: float) -> float:
        """Seconds without any partition (0 while holding some)."""
        if self.partitions or self.empty_since is None:
            return 0.0
        return max(0.0, now - self.empty_since)

    def ready(self, now: float) -> bool:
        """Joined at least once, and not without partitions for longer than ``bound``."""
        return self.joined_once and self.unassigned_for(now) <= self.bound

    def stranded(self, now: float) -> bool:
        """Out of the group, and without partitions, for longer than ``bound`` (and the current
        client has been trying to join for longer than ``bound``)."""
        joining = now - (self.joining_since if self.joining_since is not None else self.started)
        return not self.in_group and self.unassigned_for(now) > self.bound and joining > self.bound
