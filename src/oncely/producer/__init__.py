"""The write side: stage events in the caller's transaction; de-duplicate inbound requests."""

from oncely.producer.idempotency import (
    AsyncIdempotencyKeys,
    Busy,
    Claim,
    ClaimLost,
    IdempotencyError,
    IdempotencyKeys,
    InvalidKey,
    Mismatch,
)

__all__ = [
    "AsyncIdempotencyKeys",
    "Busy",
    "Claim",
    "ClaimLost",
    "IdempotencyError",
    "IdempotencyKeys",
    "InvalidKey",
    "Mismatch",
]
