"""Event ids: UUID version 7 (RFC 9562), the one place that knows their bit layout.

The leading 48 bits are Unix milliseconds, so ids sort roughly by creation and a span of time is
a range of ids: :func:`uuid7` makes one, :func:`millis_of` / :func:`moment_of` read its moment,
:func:`lowest_of_millis` / :func:`lowest_of` give the lowest id of a moment (the range edges of
partitions, completeness buckets and the console's lookups).
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from uuid import UUID

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The bits after the 48-bit milliseconds: version, random bits and variant.
_BELOW_MILLIS = 80


def uuid7(moment: datetime | None = None) -> UUID:
    """A new UUIDv7: 48-bit Unix milliseconds (now, or ``moment``'s), version 7, 74 random bits,
    RFC 4122 variant."""
    millis = (
        time.time_ns() // 1_000_000
        if moment is None
        else (moment - _EPOCH) // timedelta(milliseconds=1)
    )
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << _BELOW_MILLIS
    value |= 0x7 << 76
    value |= (rand >> 68) << 64  # 12 bits of rand_a
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)  # 62 bits of rand_b
    return UUID(int=value)


def lowest_of_millis(millis: int) -> UUID:
    """The lowest UUIDv7 of Unix millisecond ``millis`` (0 for earlier ones)."""
    return UUID(int=max(millis, 0) << _BELOW_MILLIS)


def millis_of(event_id: UUID) -> int:
    """The Unix millisecond a UUIDv7 was made at (for another version: what its first bits say)."""
    return event_id.int >> _BELOW_MILLIS


def lowest_of(moment: datetime) -> UUID:
    """The lowest UUIDv7 of ``moment``'s millisecond."""
    return lowest_of_millis((moment - _EPOCH) // timedelta(milliseconds=1))


def moment_of(event_id: UUID) -> datetime:
    """The millisecond a UUIDv7 was made at, as an aware datetime."""
    return _EPOCH + timedelta(milliseconds=millis_of(event_id))
