"""oncely: transactional outbox to Kafka to effects, with no lost events and no double effects."""

from oncely.errors import ConfigurationError, OncelyError
from oncely.events import EventType, Registry, RegistryError, UnknownEventTypeError
from oncely.producer import (
    AsyncIdempotencyKeys,
    Busy,
    Claim,
    IdempotencyKeys,
    Mismatch,
    StagedEvent,
    stage,
    stage_many,
)
from oncely.schemas.catalog import SchemaCatalog
from oncely.schemas.codec import Codec
from oncely.schemas.compatibility import CompatibilityMode
from oncely.schemas.errors import DecodeError, DecodeFailure, EncodeError

__all__ = [
    "AsyncIdempotencyKeys",
    "Busy",
    "Claim",
    "Codec",
    "CompatibilityMode",
    "ConfigurationError",
    "DecodeError",
    "DecodeFailure",
    "EncodeError",
    "EventType",
    "IdempotencyKeys",
    "Mismatch",
    "OncelyError",
    "Registry",
    "RegistryError",
    "SchemaCatalog",
    "StagedEvent",
    "UnknownEventTypeError",
    "stage",
    "stage_many",
]
