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
from oncely.producer.staging import DuplicateInTransactionError, StagedEvent, stage, stage_many

__all__ = [
    "AsyncIdempotencyKeys",
    "Busy",
    "Claim",
    "ClaimLost",
    "DuplicateInTransactionError",
    "IdempotencyError",
    "IdempotencyKeys",
    "InvalidKey",
    "Mismatch",
    "StagedEvent",
    "stage",
    "stage_many",
]
