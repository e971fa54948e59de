"""The errors of the schema layer: the catalog, encoding and decoding events.

Configuration problems (a catalog that disagrees with the code, a schema missing from the
schema registry) are :class:`~oncely.errors.ConfigurationError`: they are found at start-up or
at the first ``stage()``, and fixed in code or by a deploy step.
A record that cannot be decoded is a :class:`DecodeError`, whatever the cause, so a consumer
has one thing to catch to dead-letter a poison record.
"""

from __future__ import annotations

from enum import StrEnum

from oncely.errors import ConfigurationError, OncelyError


class CatalogError(ConfigurationError):
    """The schema catalog is malformed or disagrees with the code."""


class CommittedVersionChangedError(OncelyError):
    """The code's schema of a version differs from the committed file of that version: a
    break (bump the version), found by ``oncely schemas export``."""


class EncodeError(OncelyError):
    """An event could not be encoded."""


class SchemaNotRegisteredError(ConfigurationError):
    """The schema registry does not hold an event type's schema: register the committed
    catalog with ``oncely schemas register`` before the code that stages it runs."""


class SchemaIdNotLoadedError(ConfigurationError):
    """Encoding an ``avro-confluent`` event needs its schema id, which the codec has not loaded:
    ``stage()`` never calls the schema registry (unless ``auto_register``), so call
    ``Codec.warm()`` at start-up, outside any transaction."""


class DecodeFailure(StrEnum):
    """Why a record's value could not be decoded; :attr:`DecodeError.reason` holds one."""

    UNKNOWN_EVENT_TYPE = "unknown-event-type"
    """The record names no event type, or one this application has not registered."""
    WRONG_EVENT_TYPE = "wrong-event-type"
    """The record holds another event type than the caller expected."""
    UNKNOWN_SCHEMA = "unknown-schema"
    """The writer schema's fingerprint or schema-registry id is not known."""
    INCOMPATIBLE_SCHEMA = "incompatible-schema"
    """The writer schema cannot be resolved to the reader's (a field without default is new)."""
    CONTENT_TYPE = "content-type"
    """The ``content-type`` header is unknown or is not the event type's encoding."""
    CORRUPT = "corrupt"
    """The bytes are truncated, mis-framed or not valid in the writer's schema."""
    INVALID = "invalid"
    """The decoded data does not validate against the event model."""


class DecodeError(OncelyError):
    """A record's value could not be decoded into an event."""

    def __init__(self, reason: DecodeFailure, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"cannot decode event ({reason}): {detail}")

    def __reduce__(self) -> tuple[type[DecodeError], tuple[DecodeFailure, str]]:
        return type(self), (self.reason, self.detail)
