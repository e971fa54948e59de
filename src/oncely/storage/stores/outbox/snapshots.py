"""PostgreSQL snapshots and the difference between two of them (PgQ's read rule), as values.

A snapshot ``xmin:xmax:xip`` sees every transaction below ``xmin``, none at or above ``xmax``,
and between them those not in ``xip`` (running when it was taken). The rows new in ``reading``
compared with ``done`` are those of transactions in ``[done.xmax, reading.xmax)`` that were not
running in ``reading``, plus those that were running in ``done`` and are visible in
``reading``. Nothing below ``done.xmax`` outside ``done.xip`` can be new, whatever ``xmin`` is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A ``pg_snapshot`` value."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        """Read PostgreSQL's text form, e.g. ``"100:104:100,102"``."""
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def __str__(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(str(x) for x in sorted(self.xip))}"

    def order(self) -> tuple[int, int, int]:
        """A key that orders the snapshots of one database by when they were taken: a later
        one has a higher ``xmax``, or the same with a higher ``xmin``, or the same with fewer
        transactions in progress (only ever those of the earlier)."""
        return (self.xmax, self.xmin, -len(self.xip))

    def visible(self, txid: int) -> bool:
        """Whether the transaction ``txid`` had committed (or aborted) when this was taken."""
        return txid < self.xmin or (txid < self.xmax and txid not in self.xip)


@dataclass(frozen=True, slots=True)
class Difference:
    """The txid conditions of the rows visible in ``reading`` and not in ``done``."""

    low: int
    high: int
    running: tuple[int, ...]
    finished: tuple[int, ...]

    @classmethod
    def between(cls, done: Snapshot, reading: Snapshot) -> Difference:
        return cls(
            low=done.xmax,
            high=max(done.xmax, reading.xmax),
            running=tuple(sorted(x for x in reading.xip if x >= done.xmax)),
            finished=tuple(sorted(x for x in done.xip if reading.visible(x))),
        )

    @property
    def empty(self) -> bool:
        """No transaction can have rows in the difference: the read can be skipped."""
        return not self.finished and self.high - self.low <= len(self.running)

    def params(self) -> dict[str, object]:
        return {
            "low": str(self.low),
            "high": str(self.high),
            "running": [str(x) for x in self.running],
            "finished": [str(x) for x in self.finished],
        }
