"""The write side: stage events in the caller's transaction; de-duplicate inbound requests."""

from oncely.producer.idempotency import (
    AsyncIdempotencyKeys,
    Claim,
    ClaimLostError,
    IdempotencyBusyError,
    IdempotencyError,
    IdempotencyKeys,
    IdempotencyMismatchError,
    InvalidIdempotencyKeyError,
)
from oncely.producer.staging import stage, stage_many
from oncely.storage.stores.outbox.writes import StagedEvent
from oncely.storage.transactional import DuplicateInTransactionError

__all__ = [
    "AsyncIdempotencyKeys",
    "Claim",
    "ClaimLostError",
    "DuplicateInTransactionError",
    "IdempotencyBusyError",
    "IdempotencyError",
    "IdempotencyKeys",
    "IdempotencyMismatchError",
    "InvalidIdempotencyKeyError",
    "StagedEvent",
    "stage",
    "stage_many",
]
