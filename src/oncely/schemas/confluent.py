"""Confluent wire format: magic byte ``0x00``, 4-byte big-endian schema id, Avro body.

Values are written and read by confluent-kafka's ``AvroSerializer`` / ``AvroDeserializer``
against a Confluent-compatible schema registry. The subject is ``<topic>-value``
(``TopicNameStrategy``); the serializer registers the event type's schema on first use. The
deserializer fetches the writer schema by id and resolves it to the code's (reader) schema.
"""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError
from fastavro.read import SchemaResolutionError

from oncely.events import EventType
from oncely.schemas.errors import DecodeError, DecodeFailure, EncodeError

__all__ = ["HEADER_SIZE", "MAGIC_BYTE", "ConfluentAvro", "schema_id"]

MAGIC_BYTE = 0
HEADER_SIZE = 5
_NOT_FOUND = 404
# What fastavro raises on bytes that do not fit the writer schema (truncated, overlong, bad UTF-8).
_BODY_ERRORS = (EOFError, StopIteration, IndexError, ValueError, OverflowError, UnicodeDecodeError)


def schema_id(value: bytes) -> int:
    """Return the schema id of a Confluent-framed ``value``.

    Raises:
        DecodeError: (``corrupt``) the value is shorter than the header or lacks the magic byte.
    """
    if len(value) < HEADER_SIZE:
        raise DecodeError(
            DecodeFailure.CORRUPT,
            f"{len(value)} bytes are too short for the Confluent header ({HEADER_SIZE} bytes)",
        )
    if value[0] != MAGIC_BYTE:
        raise DecodeError(
            DecodeFailure.CORRUPT,
            f"value starts with 0x{value[0]:02x}, not the Confluent magic byte 0x00",
        )
    return int.from_bytes(value[1:HEADER_SIZE], "big")


class ConfluentAvro:
    """Encode and decode Avro datums in Confluent framing, one serializer per event type."""

    def __init__(self, *, client: SchemaRegistryClient) -> None:
        self._client = client
        self._serializers: dict[str, AvroSerializer] = {}
        self._deserializers: dict[str, AvroDeserializer] = {}
        self._writer_schemas: dict[int, dict[str, Any]] = {}

    def encode(self, event_type: EventType[Any], datum: dict[str, Any]) -> bytes:
        """Return the Confluent-framed value of ``datum``, registering the schema if needed.

        Raises:
            EncodeError: the datum does not fit the schema (e.g. a long out of range).
            SchemaRegistryError: the registry is unreachable or refuses the schema, as raised
                by confluent-kafka: an operational failure, not a property of the event.
        """
        serializer = self._serializers.get(event_type.name)
        if serializer is None:
            serializer = AvroSerializer(
                self._client,
                json.dumps(event_type.schema),
                conf={"subject.name.strategy": topic_subject_name_strategy},
            )
            self._serializers[event_type.name] = serializer
        try:
            value = serializer(datum, SerializationContext(event_type.topic, MessageField.VALUE))
        except (SerializationError, ValueError, TypeError, OverflowError) as exc:
            raise EncodeError(
                f"event type {event_type.name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(value, bytes):  # the serializer returns None only for a None datum
            raise TypeError(f"AvroSerializer returned {type(value).__name__} for {event_type.name}")
        return value

    def decode(self, event_type: EventType[Any], value: bytes) -> tuple[Any, dict[str, Any]]:
        """Return the datum of a Confluent-framed ``value`` read with ``event_type``'s schema,
        and the writer schema it was written with.

        Raises:
            DecodeError: ``corrupt`` for bad framing or body, ``unknown-schema`` when the registry
                does not know the schema id, ``incompatible-schema`` when the writer schema does
                not resolve to the reader's. Other registry errors (unreachable, 5xx)
                propagate: retry them, do not dead-letter the record.
        """
        writer_id = schema_id(value)
        deserializer = self._deserializers.get(event_type.name)
        if deserializer is None:
            deserializer = AvroDeserializer(self._client, json.dumps(event_type.schema))
            self._deserializers[event_type.name] = deserializer
        try:
            datum = deserializer(value, SerializationContext(event_type.topic, MessageField.VALUE))
            return datum, self._writer_schema(writer_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code != _NOT_FOUND:
                raise
            raise DecodeError(
                DecodeFailure.UNKNOWN_SCHEMA,
                f"the schema registry has no schema with id {writer_id}: {exc}",
            ) from exc
        except SchemaResolutionError as exc:
            raise DecodeError(
                DecodeFailure.INCOMPATIBLE_SCHEMA,
                f"schema id {writer_id} does not resolve to {event_type.name!r} "
                f"v{event_type.version}: {exc}",
            ) from exc
        except (SerializationError, *_BODY_ERRORS) as exc:
            raise DecodeError(
                DecodeFailure.CORRUPT,
                f"value does not decode with schema id {writer_id}: {type(exc).__name__}: {exc}",
            ) from exc

    def _writer_schema(self, writer_id: int) -> dict[str, Any]:
        schema = self._writer_schemas.get(writer_id)
        if schema is None:
            schema_str = self._client.get_schema(writer_id).schema_str
            if schema_str is None:
                raise DecodeError(
                    DecodeFailure.UNKNOWN_SCHEMA, f"schema id {writer_id} has no schema text"
                )
            schema = self._writer_schemas[writer_id] = json.loads(schema_str)
        return schema
