"""The codec: an event model instance to a Kafka value and headers, and back.

Each event type is written in its registered encoding, named by the ``content-type`` header:

| encoding | ``content-type`` | value |
|---|---|---|
| ``avro`` | ``application/vnd.oncely.avro`` | ``C3 01`` + 8-byte fingerprint + body |
| ``avro-confluent`` | ``application/vnd.confluent.avro`` | ``00`` + 4-byte schema id + body |
| ``json`` | ``application/json`` | UTF-8 JSON of the model (field names) |

Decoding needs to know the event type: from ``expected``, else the ``eventType`` header the
relay sets, else (``avro`` only) the writer schema's catalog entry. ``content-type`` is
optional on decode (Debezium's outbox router does not forward it); when present it must be
the event type's encoding. Every decoding failure raises :class:`DecodeError` with a
:class:`DecodeFailure` reason; nothing returns ``None``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from oncely.errors import ConfigurationError
from oncely.events import Encoding, EventType, Registry
from oncely.schemas import single_object
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry
from oncely.schemas.datum import from_datum, to_datum
from oncely.schemas.errors import CatalogError, DecodeError, DecodeFailure, EncodeError
from oncely.wire import CONTENT_TYPE_HEADER, EVENT_TYPE_HEADER, SCHEMA_VERSION_HEADER

if TYPE_CHECKING:  # the schema registry's client is an extra: oncely[confluent]
    from confluent_kafka.schema_registry import SchemaRegistryClient

    from oncely.schemas.confluent import ConfluentAvro

__all__ = [
    "CONTENT_TYPES",
    "Codec",
    "HeaderInput",
]

M = TypeVar("M", bound=BaseModel)

CONTENT_TYPES: dict[Encoding, str] = {
    "avro": "application/vnd.oncely.avro",
    "avro-confluent": "application/vnd.confluent.avro",
    "json": "application/json",
}
_ENCODING_OF = {content_type: encoding for encoding, content_type in CONTENT_TYPES.items()}
# What fastavro raises on bytes that do not fit the writer schema (truncated, overlong, bad UTF-8).
_BODY_ERRORS = (EOFError, StopIteration, IndexError, ValueError, OverflowError, UnicodeDecodeError)

HeaderValue = str | bytes | None
HeaderInput = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]] | None
"""Headers as a mapping, or as confluent-kafka's list of ``(name, bytes)`` pairs."""


class Codec:
    """Encodes events of a :class:`~oncely.events.Registry` and decodes them back.

    Args:
        registry: the application's event types; the code's schemas are always known.
        catalog: the committed schemas (``SchemaCatalog.load("schemas")``), so that values
            written with older versions decode; without it only the code's schemas are known.
        schema_registry: a Confluent schema registry client, required if any event type uses
            the ``avro-confluent`` encoding (``oncely.schemas.loader.schema_registry_client()``
            builds it from ``ONCELY_SCHEMA_REGISTRY_*``).
        auto_register: let the first encode of an ``avro-confluent`` type register its schema
            (inside the caller's transaction, when that encode is a ``stage()``). Off by
            default: ``oncely schemas register`` registers the committed catalog at deploy
            time, and encoding only looks the schema's id up.

    Encoding an ``avro-confluent`` type never calls the registry: call :meth:`warm` at
    start-up, outside any transaction, to load the schema ids (with ``auto_register`` the
    first encode of a type registers its schema instead, inside the caller's transaction).

    Raises:
        CatalogError: the code's schema of an event type differs from the committed file of the
            same version (change the version, or run ``oncely schemas export``).
        ConfigurationError: an ``avro-confluent`` event type and no ``schema_registry``.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        catalog: SchemaCatalog | None = None,
        schema_registry: SchemaRegistryClient | None = None,
        auto_register: bool = False,
    ) -> None:
        self._registry = registry
        self._catalog = catalog if catalog is not None else SchemaCatalog()
        for event_type in registry:
            _check_committed(event_type, self._catalog.find(event_type.name, event_type.version))
        confluent_types = [t.name for t in registry if t.encoding == "avro-confluent"]
        if confluent_types and schema_registry is None:
            raise ConfigurationError(
                f"event types {', '.join(confluent_types)} use avro-confluent: "
                "pass schema_registry=SchemaRegistryClient({'url': ...})"
            )
        self._confluent: ConfluentAvro | None = None
        if schema_registry is not None:
            from oncely.schemas.confluent import ConfluentAvro

            self._confluent = ConfluentAvro(client=schema_registry, auto_register=auto_register)
        self._parsed_schemas: dict[bytes, Any] = {}
        self._encoders: dict[
            type[BaseModel], tuple[EventType[Any], dict[str, str], Any, bytes]
        ] = {}
        self._writers: dict[bytes, SchemaEntry] = {}
        self._list_adapters: dict[type[BaseModel], TypeAdapter[list[Any]]] = {}

    @property
    def registry(self) -> Registry:
        """The event types this codec encodes."""
        return self._registry

    def warm(self) -> dict[str, int]:
        """Find the schema id of every ``avro-confluent`` event type now, so that encoding
        (``stage()``) never calls the schema registry; return ``{event type: schema id}``.

        Call it at start-up, outside any transaction (with ``auto_register`` it registers the
        schemas that are missing). Without ``avro-confluent`` types it does nothing.

        Raises:
            SchemaNotRegisteredError: a schema is not registered (run ``oncely schemas
                register``); the message names the event type and subject.
            SchemaRegistryError: the registry is unreachable or refuses a schema, as raised by
                confluent-kafka.
        """
        return {
            event_type.name: self._confluent_avro(event_type).schema_id(event_type)
            for event_type in self._registry
            if event_type.encoding == "avro-confluent"
        }

    def encode(self, event: BaseModel) -> tuple[bytes, dict[str, str]]:
        """Return the Kafka value of ``event`` and the headers that describe it.

        The headers are ``content-type`` and ``schema-version``; the ``eventType`` header is
        the relay's, from the outbox row.

        Raises:
            UnknownEventTypeError: ``event``'s class is not registered.
            EncodeError: the event does not fit its schema (a naive datetime, a long out of
                range, a decimal beyond its scale); the message names the event type.
            SchemaIdNotLoadedError: an ``avro-confluent`` type's schema id was not loaded by
                :meth:`warm` (and ``auto_register`` is off).
        """
        event_type, described_by, parsed, prefix = self._encoder_of(type(event))
        headers = dict(described_by)
        if event_type.encoding == "json":
            try:
                return event.model_dump_json(by_alias=False).encode(), headers
            except PydanticSerializationError as exc:
                raise EncodeError(f"event type {event_type.name!r}: {exc}") from exc
        datum = to_datum(event)
        if event_type.encoding == "avro-confluent":
            return self._confluent_avro(event_type).encode(event_type, datum), headers
        buffer = io.BytesIO()
        buffer.write(prefix)
        try:
            schemaless_writer(buffer, parsed, datum)
        except (ValueError, TypeError, OverflowError, AttributeError) as exc:
            raise EncodeError(
                f"event type {event_type.name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return buffer.getvalue(), headers

    def _encoder_of(
        self, model: type[BaseModel]
    ) -> tuple[EventType[Any], dict[str, str], Any, bytes]:
        encoder = self._encoders.get(model)
        if encoder is None:
            encoder = self._encoders[model] = self._encoder(model)
        return encoder

    def _encoder(self, model: type[BaseModel]) -> tuple[EventType[Any], dict[str, str], Any, bytes]:
        """What :meth:`encode` needs of ``model``, worked out once per model: its event type,
        the headers that describe it, its parsed schema and its single-object prefix (Avro)."""
        event_type = self._registry.for_model(model)
        headers = {
            CONTENT_TYPE_HEADER: CONTENT_TYPES[event_type.encoding],
            SCHEMA_VERSION_HEADER: str(event_type.version),
        }
        if event_type.encoding != "avro":
            return event_type, headers, None, b""
        parsed = self._parsed(SchemaEntry.of(event_type))
        return event_type, headers, parsed, single_object.frame(event_type.fingerprint, b"")

    @overload
    def decode(self, value: bytes, headers: HeaderInput = None, *, expected: type[M]) -> M: ...

    @overload
    def decode(
        self, value: bytes, headers: HeaderInput = None, *, expected: None = None
    ) -> BaseModel: ...

    def decode(
        self, value: bytes, headers: HeaderInput = None, *, expected: type[M] | None = None
    ) -> BaseModel:
        """Return the event held by a Kafka ``value``, validated by its model.

        Args:
            value: the record's value.
            headers: the record's headers (``eventType``, ``content-type`` are used).
            expected: the model the caller wants; a record of another type is an error.

        Raises:
            DecodeError: for every reason a value cannot become an event (see
                :class:`DecodeFailure`). Schema registry outages propagate as raised.
            UnknownEventTypeError: ``expected`` is not a registered model.
        """
        header_map = _header_map(headers)
        payload = bytes(value)
        event_type = self._target(payload, header_map, expected)
        content_type = header_map.get(CONTENT_TYPE_HEADER)
        if content_type is not None and _ENCODING_OF.get(content_type) != event_type.encoding:
            raise DecodeError(
                DecodeFailure.CONTENT_TYPE,
                f"content-type {content_type!r} is not {CONTENT_TYPES[event_type.encoding]!r}, "
                f"the {event_type.encoding} encoding of event type {event_type.name!r}",
            )
        model: type[BaseModel] = event_type.model
        writer: dict[str, Any] | None
        try:
            if event_type.encoding == "json":
                return model.model_validate_json(payload, by_alias=False, by_name=True)
            if event_type.encoding == "avro-confluent":
                datum, writer = self._confluent_avro(event_type).decode(event_type, payload)
            else:
                datum, writer = self._read_single_object(event_type, payload)
            return from_datum(model, datum, reader=event_type.schema, writer=writer)
        except ValidationError as exc:
            broken = any(error["type"] == "json_invalid" for error in exc.errors())
            raise DecodeError(
                DecodeFailure.CORRUPT if broken else DecodeFailure.INVALID,
                f"{event_type.name!r} value does not validate as {model.__qualname__}: {exc}",
            ) from exc

    def decode_many(
        self,
        event_type: EventType[M],
        values: Sequence[bytes],
        headers: Sequence[Mapping[str, str]],
    ) -> list[M]:
        """The events held by ``values`` (with their records' text ``headers``), all of
        ``event_type``: what :meth:`decode` of each would return, validated by one call for the
        whole run (values written with the code's own schema are read without a lookup each).

        Raises:
            DecodeError: one of them cannot be decoded (:meth:`decode` of each says which, and
                why).
        """
        content_type = CONTENT_TYPES[event_type.encoding]
        for described in headers:
            named = described.get(EVENT_TYPE_HEADER)
            if named is not None and named != event_type.name:
                raise DecodeError(DecodeFailure.WRONG_EVENT_TYPE, f"a {named!r} event")
            found = described.get(CONTENT_TYPE_HEADER)
            if found is not None and found != content_type:
                raise DecodeError(DecodeFailure.CONTENT_TYPE, f"content-type {found!r}")
        model = event_type.model
        if event_type.encoding != "avro":
            return [
                self.decode(value, described, expected=model)
                for value, described in zip(values, headers, strict=True)
            ]
        _, _, parsed, prefix = self._encoder_of(model)
        start = len(prefix)
        datums = []
        for value in values:
            if value[:start] != prefix:  # an older writer schema: resolved one by one
                return [
                    self.decode(value, described, expected=model)
                    for value, described in zip(values, headers, strict=True)
                ]
            buffer = io.BytesIO(value)
            buffer.seek(start)
            try:
                datums.append(schemaless_reader(buffer, parsed, None))
            except _BODY_ERRORS as exc:
                raise DecodeError(DecodeFailure.CORRUPT, str(exc)) from exc
            if buffer.tell() != len(value):
                raise DecodeError(DecodeFailure.CORRUPT, "trailing bytes after the datum")
        adapter = self._list_adapters.get(model)
        if adapter is None:
            adapter = self._list_adapters[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
        try:
            return cast(list[M], adapter.validate_python(datums, by_alias=False, by_name=True))
        except ValidationError as exc:
            raise DecodeError(DecodeFailure.INVALID, str(exc)) from exc

    def _target(
        self, payload: bytes, headers: Mapping[str, str], expected: type[BaseModel] | None
    ) -> EventType[Any]:
        """Find the event type to decode into, checking the sources of it agree."""
        named = headers.get(EVENT_TYPE_HEADER)
        if expected is not None:
            event_type = self._registry.for_model(expected)
            if named is not None and named != event_type.name:
                raise DecodeError(
                    DecodeFailure.WRONG_EVENT_TYPE,
                    f"record is a {named!r} event, expected {event_type.name!r}",
                )
            return event_type
        if named is None and payload[:2] == single_object.MARKER:
            entry = self._writer(single_object.unframe(payload)[0])
            named = entry.event_type if entry is not None else None
        if named is None:
            raise DecodeError(
                DecodeFailure.UNKNOWN_EVENT_TYPE,
                f"record has no {EVENT_TYPE_HEADER!r} header and the caller expected no type",
            )
        if named not in self._registry:
            raise DecodeError(
                DecodeFailure.UNKNOWN_EVENT_TYPE,
                f"no durable topic registered for event type {named!r}",
            )
        return self._registry.get(named)

    def _read_single_object(
        self, event_type: EventType[Any], payload: bytes
    ) -> tuple[Any, dict[str, Any] | None]:
        """The datum, and the writer schema if it differs from ``event_type``'s."""
        fingerprint, body = single_object.unframe(payload)
        writer = self._writer(fingerprint)
        if writer is None:
            raise DecodeError(
                DecodeFailure.UNKNOWN_SCHEMA, self._unknown_writer(event_type, fingerprint)
            )
        if writer.event_type != event_type.name:
            raise DecodeError(
                DecodeFailure.WRONG_EVENT_TYPE,
                f"value was written as {writer.event_type!r} v{writer.version}, "
                f"expected {event_type.name!r}",
            )
        same = writer.fingerprint == event_type.fingerprint
        buffer = io.BytesIO(body)
        try:
            datum = schemaless_reader(
                buffer,
                self._parsed(writer),
                None if same else self._parsed(self._reader(event_type)),
            )
        except SchemaResolutionError as exc:
            raise DecodeError(
                DecodeFailure.INCOMPATIBLE_SCHEMA,
                f"{writer.describe()} does not resolve to {event_type.name!r} "
                f"v{event_type.version}: {exc}",
            ) from exc
        except _BODY_ERRORS as exc:
            raise DecodeError(
                DecodeFailure.CORRUPT,
                f"body does not decode with {writer.describe()}: {type(exc).__name__}: {exc}",
            ) from exc
        if buffer.tell() != len(body):
            raise DecodeError(
                DecodeFailure.CORRUPT,
                f"{len(body) - buffer.tell()} trailing bytes after the {event_type.name!r} datum",
            )
        return datum, None if same else writer.schema

    def _unknown_writer(self, event_type: EventType[Any], fingerprint: bytes) -> str:
        """Why a value whose writer schema is unknown cannot be read, and what to do."""
        directory = self._catalog.directory
        searched = (
            f"the schema catalog {directory}"
            if directory is not None
            else "a schema catalog (none was loaded)"
        )
        return (
            f"event type {event_type.name!r}: writer schema fingerprint {fingerprint.hex()} is "
            f"in neither the code (v{event_type.version}) nor {searched}; export the writer's "
            "version into the catalog with `oncely schemas export`"
        )

    def _writer(self, fingerprint: bytes) -> SchemaEntry | None:
        """The schema with ``fingerprint``: a committed one, else a registered type's own.

        Found once per fingerprint (an unknown one is looked up again each time, so that hostile
        values cannot grow the cache)."""
        found = self._writers.get(fingerprint)
        if found is not None:
            return found
        found = self._catalog.by_fingerprint(fingerprint)
        if found is None:
            found = next(
                (SchemaEntry.of(t) for t in self._registry if t.fingerprint == fingerprint), None
            )
        if found is not None:
            self._writers[fingerprint] = found
        return found

    def _reader(self, event_type: EventType[Any]) -> SchemaEntry:
        """The code's own schema of ``event_type`` (found once, as writers are)."""
        return self._writer(event_type.fingerprint) or SchemaEntry.of(event_type)

    def _parsed(self, entry: SchemaEntry) -> Any:
        """fastavro's parsed form of ``entry``'s schema, parsed once per fingerprint."""
        parsed = self._parsed_schemas.get(entry.fingerprint)
        if parsed is None:
            parsed = self._parsed_schemas[entry.fingerprint] = parse_schema(entry.schema)
        return parsed

    def _confluent_avro(self, event_type: EventType[Any]) -> ConfluentAvro:
        if self._confluent is None:
            raise ConfigurationError(
                f"event type {event_type.name!r} uses avro-confluent and the codec has no "
                "schema_registry client"
            )
        return self._confluent


def _check_committed(event_type: EventType[Any], committed: SchemaEntry | None) -> None:
    if committed is not None and committed.fingerprint != event_type.fingerprint:
        raise CatalogError(
            f"the code's schema of {event_type.name!r} v{event_type.version} differs from the "
            f"committed {committed.describe()}; bump the version (and export it) instead of "
            "changing a committed one"
        )


def _header_map(headers: HeaderInput) -> Mapping[str, str]:
    if type(headers) is dict and all(type(v) is str for v in headers.values()):
        return cast(Mapping[str, str], headers)  # already text (a consumer's): not parsed again
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    result = {}
    for name, raw in pairs:
        if raw is None:
            continue
        try:
            result[name] = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            raise DecodeError(
                DecodeFailure.CORRUPT, f"header {name!r} is not UTF-8: {exc}"
            ) from exc
    return result
