"""Derive the Avro schema of an event model: the contract its events are written with.

The mapping from pydantic field annotations to Avro:

==============================================  ============================================
Python                                          Avro
==============================================  ============================================
``str`` / ``int`` / ``float`` / ``bool``        ``string`` / ``long`` / ``double`` / ``boolean``
``bytes``                                       ``bytes``
``Decimal`` with ``max_digits`` and             ``bytes`` with logical type ``decimal``
``decimal_places`` declared (``Field`` or       (``precision`` = max_digits, ``scale`` =
``condecimal``)                                 decimal_places)
``UUID``                                        ``string`` with logical type ``uuid``
``datetime`` / ``AwareDatetime``                ``long`` with logical type ``timestamp-micros``
``date``                                        ``int`` with logical type ``date``
``Enum`` whose values are strings               ``enum``; the symbols are the values
a ``BaseModel``                                 ``record``, defined once, then named
``list[X]``                                     ``array``
``dict[str, X]``                                ``map``
``X | None``                                    ``["null", X]``
==============================================  ============================================

``Annotated`` constraints are kept where they matter (decimal precision) and ignored
otherwise. Anything else (other unions, tuples, sets, ``Any``) is refused with a
:class:`~oncely.errors.ConfigurationError` naming the field, when the event type is declared.

Names are stable across code refactors: the top-level record is named after the event type
(``transfer.completed`` gives ``transfer.completed.TransferCompleted``); nested records and
enums are named after their class, in the same namespace. Pydantic field names (not aliases)
are the Avro field names. Field defaults become Avro defaults, in the first branch of an
optional field's union (``["null", X]`` for a ``None`` default, ``[X, "null"]`` otherwise);
a ``default_factory`` of ``list`` or ``dict`` gives ``[]`` or ``{}``, other factories no default.
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Union, get_args, get_origin
from uuid import UUID

from fastavro.schema import SchemaParseException, parse_schema
from pydantic import AwareDatetime, BaseModel
from pydantic.fields import FieldInfo

from oncely.errors import ConfigurationError

__all__ = ["SchemaDerivationError", "avro_namespace", "event_schema", "record_name"]


class SchemaDerivationError(ConfigurationError):
    """An event model cannot be described by an Avro schema."""


_AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PRIMITIVES: dict[object, str] = {
    str: "string",
    int: "long",
    float: "double",
    bool: "boolean",
    bytes: "bytes",
}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DATE = date(1970, 1, 1)
_NO_DEFAULT = object()


def avro_namespace(event_type: str) -> str:
    """Return the Avro namespace of an event type's schema: its name, made of Avro identifiers.

    ``transfer.completed`` stays ``transfer.completed``; characters Avro names cannot hold
    become ``_`` and a part starting with a digit gets a leading ``_``.
    """
    return ".".join(_identifier(part) for part in event_type.split("."))


def record_name(event_type: str) -> str:
    """Return the name of an event type's top-level record: ``transfer.completed`` gives
    ``TransferCompleted``."""
    name = "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", event_type))
    return _identifier(name)


def event_schema(model: type[BaseModel], *, event_type: str) -> dict[str, Any]:
    """Return the Avro schema (as a JSON object) of ``model`` declared as ``event_type``.

    The result is deterministic for a given model and event type, so its bytes can be committed.

    Raises:
        SchemaDerivationError: a field has a type without Avro mapping, a ``Decimal`` without
            declared precision and scale, an enum value that is not an Avro name, two classes
            with one name, or a default that does not fit its schema; the message names the field.
    """
    schema = _Builder().define_record(
        model, name=record_name(event_type), namespace=avro_namespace(event_type)
    )
    try:
        parse_schema(schema)
    except (SchemaParseException, ValueError) as exc:
        raise SchemaDerivationError(f"{model.__qualname__}: invalid Avro schema: {exc}") from exc
    return schema


def _identifier(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", text)
    return f"_{name}" if not name or name[0].isdigit() else name


def _check_name(name: str, where: str) -> None:
    if not _AVRO_NAME.fullmatch(name):
        raise SchemaDerivationError(
            f"{where}: {name!r} is not a valid Avro name ([A-Za-z_][A-Za-z0-9_]*)"
        )


def _metadata(extras: Sequence[object]) -> list[object]:
    """Flatten ``Annotated`` extras: a ``FieldInfo`` contributes its own constraint metadata."""
    flat: list[object] = []
    for extra in extras:
        flat.extend(extra.metadata if isinstance(extra, FieldInfo) else [extra])
    return flat


class _Builder:
    """Builds one schema, tracking the named types it has defined."""

    def __init__(self) -> None:
        self._named: dict[str, tuple[type, dict[str, Any]]] = {}

    def define_record(
        self, model: type[BaseModel], *, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "record", "name": name}
        if namespace is not None:
            schema["namespace"] = namespace
        self._register(name, model, schema)
        doc = model.__dict__.get("__doc__")
        if isinstance(doc, str) and doc.strip():
            schema["doc"] = inspect.cleandoc(doc)
        schema["fields"] = [
            self._field(model, field_name, info) for field_name, info in model.model_fields.items()
        ]
        return schema

    def _name_of(self, cls: type) -> str | None:
        """The name ``cls`` is defined under in this schema (the top record's differs)."""
        return next((name for name, (owner, _) in self._named.items() if owner is cls), None)

    def _register(self, name: str, cls: type, schema: dict[str, Any]) -> None:
        """Define the named type ``name`` as ``cls``'s; refuse a second class of that name."""
        if name in self._named:
            taken_by = self._named[name][0]
            raise SchemaDerivationError(
                f"{cls.__qualname__}: its Avro name {name!r} is already used by "
                f"{taken_by.__module__}.{taken_by.__qualname__} in this schema; rename one"
            )
        self._named[name] = (cls, schema)

    def _field(self, model: type[BaseModel], name: str, info: FieldInfo) -> dict[str, Any]:
        where = f"{model.__qualname__}.{name}"
        _check_name(name, where)
        schema = self._type(info.annotation, info.metadata, where)
        field: dict[str, Any] = {"name": name, "type": schema}
        default = _python_default(info)
        if default is not _NO_DEFAULT:
            if isinstance(schema, list) and default is not None:
                schema = [branch for branch in schema if branch != "null"] + ["null"]
                field["type"] = schema
            field["default"] = self._default(default, schema, where)
        if info.description:
            field["doc"] = info.description
        return field

    def _type(self, annotation: Any, metadata: Sequence[object], where: str) -> Any:
        origin = get_origin(annotation)
        if origin is Annotated:
            base, *extras = get_args(annotation)
            return self._type(base, [*metadata, *_metadata(extras)], where)
        if origin in (Union, types.UnionType):
            return self._optional(annotation, metadata, where)
        if origin is list and len(get_args(annotation)) == 1:
            (items,) = get_args(annotation)
            return {"type": "array", "items": self._type(items, (), f"{where}[]")}
        if origin is dict and len(get_args(annotation)) == 2:
            keys, values = get_args(annotation)
            if keys is not str:
                raise SchemaDerivationError(f"{where}: Avro map keys are strings, not {keys!r}")
            return {"type": "map", "values": self._type(values, (), f"{where}[]")}
        if annotation in _PRIMITIVES:
            return _PRIMITIVES[annotation]
        if annotation is Decimal:
            return _decimal(metadata, where)
        if annotation is UUID:
            return {"type": "string", "logicalType": "uuid"}
        if annotation is datetime or annotation is AwareDatetime:
            return {"type": "long", "logicalType": "timestamp-micros"}
        if annotation is date:
            return {"type": "int", "logicalType": "date"}
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return self._enum(annotation, where)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if (defined := self._name_of(annotation)) is not None:
                return defined
            _check_name(annotation.__name__, where)
            return self.define_record(annotation, name=annotation.__name__)
        raise SchemaDerivationError(
            f"{where}: type {annotation!r} has no Avro mapping (supported: str, int, float, "
            "bool, bytes, Decimal, UUID, datetime, date, Enum, BaseModel, list, dict, X | None)"
        )

    def _optional(self, annotation: Any, metadata: Sequence[object], where: str) -> list[Any]:
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(members) != 1 or len(get_args(annotation)) != 2:
            raise SchemaDerivationError(
                f"{where}: only `X | None` unions have an Avro mapping, not {annotation!r}"
            )
        return ["null", self._type(members[0], metadata, where)]

    def _enum(self, enum: type[Enum], where: str) -> dict[str, Any] | str:
        if (defined := self._name_of(enum)) is not None:
            return defined
        _check_name(enum.__name__, where)
        symbols = []
        for member in enum:
            if not isinstance(member.value, str):
                raise SchemaDerivationError(
                    f"{where}: enum {enum.__qualname__} member {member.name} has a "
                    f"{type(member.value).__name__} value; Avro enums need string values"
                )
            _check_name(member.value, f"{where} (enum {enum.__qualname__})")
            symbols.append(member.value)
        schema = {"type": "enum", "name": enum.__name__, "symbols": symbols}
        self._register(enum.__name__, enum, schema)
        return schema

    def _default(self, value: Any, schema: Any, where: str) -> Any:
        """Render a Python default in Avro's JSON form for ``schema``."""
        if isinstance(schema, list):
            return self._default(value, schema[0], where)
        if isinstance(schema, str) and schema in self._named:
            schema = self._named[schema][1]
        try:
            return self._render(value, schema, where)
        except (TypeError, ValueError, AttributeError) as exc:
            raise SchemaDerivationError(
                f"{where}: default {value!r} does not fit the Avro schema {schema!r}: {exc}"
            ) from exc

    def _render(self, value: Any, schema: Any, where: str) -> Any:
        if isinstance(schema, str):
            return _render_primitive(value, schema)
        logical = schema.get("logicalType")
        if logical == "decimal":
            return _decimal_bytes(value, scale=schema["scale"]).decode("latin-1")
        if logical == "uuid":
            return str(UUID(str(value)))
        if logical == "timestamp-micros":
            return _timestamp_micros(value)
        if logical == "date":
            return (value - _EPOCH_DATE).days
        kind = schema["type"]
        if kind == "enum":
            return value.value if isinstance(value, Enum) else str(value)
        if kind == "array":
            return [self._default(item, schema["items"], where) for item in value]
        if kind == "map":
            return {str(k): self._default(v, schema["values"], where) for k, v in value.items()}
        fields = value if isinstance(value, dict) else dict(value)
        return {
            field["name"]: self._default(fields[field["name"]], field["type"], where)
            for field in schema["fields"]
        }


def _render_primitive(value: Any, schema: str) -> Any:
    if schema == "null":
        if value is not None:
            raise ValueError("only None fits null")
        return None
    converters: dict[str, Any] = {
        "boolean": bool,
        "long": int,
        "double": float,
        "string": str,
        "bytes": lambda raw: bytes(raw).decode("latin-1"),
    }
    return converters[schema](value)


def _python_default(info: FieldInfo) -> Any:
    if info.is_required():
        return _NO_DEFAULT
    if info.default_factory is list:
        return []
    if info.default_factory is dict:
        return {}
    if info.default_factory is not None:
        return _NO_DEFAULT
    return info.default


def _decimal(metadata: Sequence[object], where: str) -> dict[str, Any]:
    precision = scale = None
    for item in metadata:
        precision = getattr(item, "max_digits", None) or precision
        found_scale = getattr(item, "decimal_places", None)
        scale = found_scale if found_scale is not None else scale
    if precision is None or scale is None:
        raise SchemaDerivationError(
            f"{where}: a Decimal needs its precision and scale declared for Avro, e.g. "
            "Annotated[Decimal, Field(max_digits=18, decimal_places=2)]"
        )
    if scale > precision:
        raise SchemaDerivationError(
            f"{where}: decimal_places ({scale}) exceeds max_digits ({precision})"
        )
    return {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}


def _decimal_bytes(value: Decimal, *, scale: int) -> bytes:
    """Return Avro's decimal bytes of ``value`` at ``scale``: the unscaled integer, big-endian
    two's complement. Raises ``ValueError`` if ``value`` has more decimal places than ``scale``."""
    exponent = value.as_tuple().exponent
    if not isinstance(exponent, int) or exponent < -scale:
        raise ValueError(f"{value} does not fit scale {scale}")
    unscaled = int(value.scaleb(scale))
    return unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)


def _timestamp_micros(value: datetime) -> int:
    """Return the microseconds since the Unix epoch of a timezone-aware ``value``.

    Raises ``ValueError`` for a naive datetime: it names no instant."""
    if value.tzinfo is None:
        raise ValueError(f"naive datetime {value.isoformat()} has no time zone")
    return (value - _EPOCH) // timedelta(microseconds=1)
