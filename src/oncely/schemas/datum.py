"""Convert between an event model instance and its Avro datum (what fastavro reads and writes).

The datum mirrors :func:`oncely.events.avro.event_schema`: nested models become dicts keyed by
field name, enum members become their values; ``Decimal``, ``UUID``, ``datetime`` and ``date``
stay Python objects, which fastavro encodes with their logical types. Reading back gives the
same values: timestamps come back as UTC-aware datetimes (the same instant), decimals at the
schema's scale (equal values).

When the writer schema lacks a field of the reader's, Avro resolution fills in the reader's
default, but fastavro fills it in its JSON form (a decimal default as a latin-1 string, a
timestamp as an integer). :func:`from_datum` therefore drops such fields and lets the model
apply its own default, which is where the reader schema's default came from.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel

from oncely.schemas.errors import EncodeError

__all__ = ["from_datum", "to_datum"]

M = TypeVar("M", bound=BaseModel)


def to_datum(event: BaseModel) -> dict[str, Any]:
    """Return the Avro datum of ``event``.

    Raises:
        EncodeError: a datetime is naive (it names no instant); the message names the field.
    """
    return _model(event, type(event).__qualname__)


def from_datum(
    model: type[M],
    datum: Any,
    *,
    reader: dict[str, Any] | None = None,
    writer: dict[str, Any] | None = None,
) -> M:
    """Validate a decoded Avro datum into ``model`` (by field name).

    Pass the ``reader`` schema (``model``'s) and the ``writer`` schema when they differ, so
    that fields the writer did not have take the model's defaults.

    Raises:
        pydantic.ValidationError: the datum does not fit the model.
    """
    if reader is not None and writer is not None:
        _prune(datum, reader, _named_types(reader, {}), _record_fields(writer))
    return model.model_validate(datum, by_alias=False, by_name=True)


def _model(event: BaseModel, path: str) -> dict[str, Any]:
    return {
        name: _value(getattr(event, name), f"{path}.{name}") for name in type(event).model_fields
    }


def _value(value: Any, path: str) -> Any:
    if isinstance(value, BaseModel):
        return _model(value, path)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime) and value.tzinfo is None:
        raise EncodeError(
            f"{path} is a naive datetime ({value.isoformat()}); Avro timestamps need a time "
            "zone: use a timezone-aware datetime (pydantic AwareDatetime)"
        )
    if isinstance(value, list):
        return [_value(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, dict):
        return {key: _value(item, f"{path}[{key!r}]") for key, item in value.items()}
    return value


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _named_types(schema: Any, found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Collect the named types a schema defines, by short name."""
    if isinstance(schema, list):
        for branch in schema:
            _named_types(branch, found)
    elif isinstance(schema, dict):
        kind = schema["type"]
        if kind in ("record", "enum", "fixed"):
            found[_short(schema["name"])] = schema
        if kind == "record":
            for field in schema["fields"]:
                _named_types(field["type"], found)
        elif kind == "array":
            _named_types(schema["items"], found)
        elif kind == "map":
            _named_types(schema["values"], found)
    return found


def _record_fields(schema: Any) -> dict[str, set[str]]:
    return {
        name: {field["name"] for field in definition["fields"]}
        for name, definition in _named_types(schema, {}).items()
        if definition["type"] == "record"
    }


def _prune(
    value: Any,
    schema: Any,
    definitions: dict[str, dict[str, Any]],
    writer_fields: dict[str, set[str]],
) -> None:
    """Remove, in place, the record fields of ``value`` that the writer's records lack."""
    if isinstance(schema, str):
        schema = definitions.get(_short(schema))
    if value is None or schema is None:
        return
    if isinstance(schema, list):
        for branch in schema:
            _prune(value, branch, definitions, writer_fields)
        return
    kind = schema["type"]
    if kind == "record" and isinstance(value, dict):
        written = writer_fields.get(_short(schema["name"]))
        for field in schema["fields"]:
            if written is not None and field["name"] not in written:
                value.pop(field["name"], None)
            elif field["name"] in value:
                _prune(value[field["name"]], field["type"], definitions, writer_fields)
    elif kind == "array" and isinstance(value, list):
        for item in value:
            _prune(item, schema["items"], definitions, writer_fields)
    elif kind == "map" and isinstance(value, dict):
        for item in value.values():
            _prune(item, schema["values"], definitions, writer_fields)
