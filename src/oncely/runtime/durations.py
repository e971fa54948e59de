"""The moments operators type, at the command line and in the console: an ISO-8601 time, or a
duration (:mod:`oncely.durations`' grammar) meaning that long ago.
"""

from __future__ import annotations

from datetime import UTC, datetime

from oncely.durations import parse_duration


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
