"""The one grammar of durations (``90s``, ``15m``, ``12h``, ``7d``) and of moments (ISO-8601, or
a duration meaning that long ago) that operators type, at the command line and in the console.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h`` or ``7d`` as a ``timedelta``; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 12h or 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def parse_moment(text: str, *, now: datetime | None = None) -> datetime:
    """An ISO-8601 time (naive means UTC), or a duration (``15m``) meaning that long before
    ``now`` (default: the clock's now). Raises ``ValueError`` for anything else."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        if _DURATION.fullmatch(text.strip()) is None:
            raise ValueError(
                f"{text!r} is neither an ISO-8601 time (2026-11-29T09:00:00Z) nor a duration "
                "ago (15m, 12h)"
            ) from None
        return (now or datetime.now(UTC)) - parse_duration(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
