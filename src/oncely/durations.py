"""The one grammar of the durations people type (``90s``, ``15m``, ``12h``, ``7d``) and the one
way oncely writes a duration back: command-line options, partition steps, the test plugin's
options and the messages about them all read and write durations here; and the moments
operators type (an ISO-8601 time, or a duration meaning that long ago), at the command line and
in the console.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
#: The units, largest first, in seconds.
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``7d`` or ``1.5h`` (a number and one unit, any case) as a
    ``timedelta``; ``ValueError`` otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 90s, 15m, 12h or 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def describe(duration: timedelta) -> str:
    """``duration`` as :func:`parse_duration` reads it: in the largest unit that measures it
    whole in at most three digits (``1d``, ``6h``, ``90m``, ``45s``), else in the largest unit
    it reaches, to three significant digits (``2.14d``)."""
    seconds = duration.total_seconds()
    for unit, size in _UNIT_SECONDS.items():
        count = seconds / size
        if count.is_integer() and 1 <= count < 1000:
            return f"{int(count)}{unit}"
    unit, size = next(
        ((unit, size) for unit, size in _UNIT_SECONDS.items() if seconds >= size), ("s", 1)
    )
    count = seconds / size
    return f"{count:.{max(3, len(str(int(count))))}g}{unit}"


def parse_moment(text: str, *, now: datetime | None = None) -> datetime:
    """An ISO-8601 time (naive means UTC), or a duration (``15m``) meaning that long before
    ``now`` (default: the clock's now). Raises ``ValueError`` for anything else."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        try:
            ago = parse_duration(text)
        except ValueError:
            raise ValueError(
                f"{text!r} is neither an ISO-8601 time (2026-11-29T09:00:00Z) nor a duration "
                "ago (15m, 12h)"
            ) from None
        return (now or datetime.now(UTC)) - ago
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
