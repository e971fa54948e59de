"""Event ids: UUID version 7 (RFC 9562), time-ordered so ids sort roughly by creation."""

from __future__ import annotations

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    """A new UUIDv7: 48-bit Unix milliseconds, version 7, 74 random bits, RFC 4122 variant."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= (rand >> 68) << 64  # 12 bits of rand_a
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)  # 62 bits of rand_b
    return uuid.UUID(int=value)
