"""The event registry: each durable event type's topic, key, aggregate, schema version and encoding.

An application declares its event types once, as pydantic models::

    registry = Registry(topic_prefix="payments.")

    @registry.event("transfer.completed", key="transfer_id", aggregate="transfer", version=2)
    class TransferCompleted(BaseModel): ...

Each type has exactly one topic (``topic_prefix`` + its name unless ``topic=`` says otherwise);
one event reaches several effects through one consumer group per effect on that topic.
Declaring derives the type's Avro schema, so a model without an Avro mapping fails at import
time, naming the field. Every error is a :class:`RegistryError` (a ``ConfigurationError``)
that names the offending type, topic or field.
"""

from oncely.events.avro import SchemaDerivationError
from oncely.events.registry import (
    ENCODINGS,
    DuplicateEventTypeError,
    DuplicateTopicError,
    Encoding,
    EventDeclarationError,
    EventType,
    InvalidTopicNameError,
    Registry,
    RegistryError,
    TopicNameWarning,
    UnknownEventTypeError,
    registry_of,
    validate_topic_name,
)

__all__ = [
    "ENCODINGS",
    "DuplicateEventTypeError",
    "DuplicateTopicError",
    "Encoding",
    "EventDeclarationError",
    "EventType",
    "InvalidTopicNameError",
    "Registry",
    "RegistryError",
    "SchemaDerivationError",
    "TopicNameWarning",
    "UnknownEventTypeError",
    "registry_of",
    "validate_topic_name",
]
