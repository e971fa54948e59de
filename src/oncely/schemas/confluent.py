"""Confluent wire format: magic byte ``0x00``, 4-byte big-endian schema id, Avro body.

Values are written and read by confluent-kafka's ``AvroSerializer`` / ``AvroDeserializer``
against a Confluent-compatible schema registry. The subject is ``<topic>-value``
(``TopicNameStrategy``, :func:`subject_of`). By default encoding never calls the registry: the
id of the event type's exact schema text (:func:`schema_text`), registered beforehand by
``oncely schemas register``, is looked up once per process by :meth:`ConfluentAvro.schema_id`
(``Codec.warm()`` at start-up); with ``auto_register`` the first encode of a type registers its
schema instead. The deserializer fetches the writer schema by id
and resolves it to the code's (reader) schema.
"""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka.schema_registry import (
    Schema,
    SchemaRegistryClient,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError
from fastavro.read import SchemaResolutionError

from oncely.events import EventType
from oncely.schemas.errors import (
    DecodeError,
    DecodeFailure,
    EncodeError,
    SchemaIdNotLoadedError,
    SchemaNotRegisteredError,
)

__all__ = [
    "HEADER_SIZE",
    "MAGIC_BYTE",
    "ConfluentAvro",
    "new_client",
    "schema_id",
    "schema_text",
    "subject_of",
]

MAGIC_BYTE = 0
HEADER_SIZE = 5
_NOT_FOUND = 404
#: The registry's error codes for "no such subject" and "no such schema under the subject".
NOT_REGISTERED_CODES = frozenset({40401, 40403})
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


class _ClosingClient(SchemaRegistryClient):
    """A client that closes its HTTP connections when it is garbage-collected: a codec built
    from settings owns its client, and a dropped codec must not leave sockets open."""

    def __del__(self) -> None:
        self.close()


def new_client(config: dict[str, str]) -> SchemaRegistryClient:
    """A schema registry client for ``config`` (``mock://`` URLs: confluent-kafka's in-memory
    mock, for unit tests); it closes its connections when it is garbage-collected."""
    if config["url"].startswith("mock://"):
        return SchemaRegistryClient.new_client(config)
    return _ClosingClient(config)


def subject_of(event_type: EventType[Any]) -> str:
    """The subject of ``event_type``'s values: ``<topic>-value``, as the serializer's
    ``topic_subject_name_strategy`` names it."""
    return f"{event_type.topic}-{MessageField.VALUE}"


def schema_text(schema: dict[str, Any]) -> str:
    """The text a schema is registered and looked up as: registries compare schemas by text
    (Apicurio by a hash of it), so registration and ``stage()`` must send the same one."""
    return json.dumps(schema)


class ConfluentAvro:
    """Encode and decode Avro datums in Confluent framing, one serializer per event type.

    ``auto_register`` lets the first encode of an event type register its schema; without it
    the schema must be registered already (``oncely schemas register``) and its id loaded by
    :meth:`schema_id` before the first encode, which then makes no HTTP call.
    """

    def __init__(self, *, client: SchemaRegistryClient, auto_register: bool = False) -> None:
        self._client = client
        self._auto_register = auto_register
        self._ids: dict[str, int] = {}
        self._serializers: dict[str, AvroSerializer] = {}
        self._deserializers: dict[str, AvroDeserializer] = {}
        self._writer_schemas: dict[int, dict[str, Any]] = {}

    def schema_id(self, event_type: EventType[Any]) -> int:
        """The registry's id of ``event_type``'s schema under its subject: looked up (with
        ``auto_register``: registered) on the first call, then known without any HTTP call.

        Raises:
            SchemaNotRegisteredError: the schema is not registered under the subject (and
                ``auto_register`` is off); the message says to run ``oncely schemas register``.
            SchemaRegistryError: the registry is unreachable or refuses the schema, as raised
                by confluent-kafka: an operational failure, not a property of the event.
        """
        known = self._ids.get(event_type.name)
        if known is not None:
            return known
        subject = subject_of(event_type)
        schema = Schema(schema_text(event_type.schema), "AVRO")
        try:
            if self._auto_register:  # the calls the serializer makes: its first use hits the cache
                registered = self._client.register_schema_full_response(subject, schema)
            else:
                registered = self._client.lookup_schema(subject, schema)
        except SchemaRegistryError as exc:
            if self._auto_register or exc.error_code not in NOT_REGISTERED_CODES:
                raise
            raise SchemaNotRegisteredError(
                f"event type {event_type.name!r} v{event_type.version}: its schema is not "
                f"registered under subject {subject!r} in the schema registry; run `oncely "
                "schemas register --app <module:app>` before deploying the code that stages it "
                "(or set ONCELY_SCHEMA_REGISTRY_AUTO_REGISTER=true to register on first use)"
            ) from None
        if registered.schema_id is None:
            raise TypeError(f"the schema registry returned no id for subject {subject!r}")
        self._ids[event_type.name] = registered.schema_id
        return registered.schema_id

    def encode(self, event_type: EventType[Any], datum: dict[str, Any]) -> bytes:
        """Return the Confluent-framed value of ``datum``; no HTTP call unless ``auto_register``
            (whose first encode of a type registers its schema).

            Raises:
                EncodeError: the datum does not fit the schema (e.g. a long out of range).
                SchemaIdNotLoadedError: without ``auto_register``, :meth:`schema_id` has not loaded
                    the type's id yet.
                SchemaIdNotLoadedError,
        SchemaNotRegisteredError, SchemaRegistryError: with ``auto_register``, as
                    :meth:`schema_id`.
        """
        if event_type.name not in self._ids:
            if not self._auto_register:
                raise SchemaIdNotLoadedError(
                    f"event type {event_type.name!r}: its schema id is not loaded, and encoding "
                    "never calls the schema registry (it would be inside the business "
                    "transaction): call codec.warm() at start-up, outside any transaction"
                )
            self.schema_id(event_type)
        serializer = self._serializers.get(event_type.name)
        if serializer is None:
            serializer = AvroSerializer(
                self._client,
                schema_text(event_type.schema),
                conf={
                    "subject.name.strategy": topic_subject_name_strategy,
                    "auto.register.schemas": self._auto_register,
                    "use.latest.version": False,
                },
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
