"""Schema evolution rules: is the code's schema compatible with the committed versions?

Built on Apache Avro's ``avro.compatibility.ReaderWriterCompatibilityChecker`` (can a reader
schema read what a writer schema wrote?), composed into the schema registry's modes:

* ``BACKWARD``: the code's schema reads data written with the committed versions;
* ``FORWARD``: the committed versions read data written with the code's schema;
* ``FULL``: both.

Non-transitive checks compare with the latest committed version older than the code's;
transitive checks compare with every older one. A committed file of the code's own version
must hold the code's schema (committed versions never change), and no committed version may
be newer than the code's.

The Avro checker ignores logical types, so they are compared here as well, at every place the
two schemas read each other (record fields, array items, map values, union branches): the
same data must carry the same logical type on both sides (``timestamp-millis`` read as
``timestamp-micros`` is a 1000x time error, a plain ``string`` read as ``uuid`` fails on the
first other string, ``date`` read as a plain ``int`` loses its meaning), and decimals the same
precision and scale (a changed scale silently rescales every value). Every logical type of the
Avro 1.12 specification is known: ``decimal``, ``big-decimal``, ``uuid``, ``date``,
``time-millis``, ``time-micros``, ``timestamp-{millis,micros,nanos}``,
``local-timestamp-{millis,micros,nanos}`` and ``duration``; a logical type on a type that
cannot carry it is ignored, as the specification says.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from avro.compatibility import (
    ReaderWriterCompatibilityChecker,
    SchemaCompatibilityResult,
    SchemaCompatibilityType,
    lookup_writer_field,
)
from avro.errors import IgnoredLogicalType
from avro.schema import ArraySchema, MapSchema, RecordSchema, Schema, UnionSchema, parse

from oncely.events import EventType
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry

__all__ = ["CompatibilityMode", "Incompatibility", "check_compatibility", "incompatibilities"]


class CompatibilityMode(StrEnum):
    """Which direction(s) of reading a schema change must keep working."""

    BACKWARD = "BACKWARD"
    FORWARD = "FORWARD"
    FULL = "FULL"


@dataclass(frozen=True, slots=True)
class Incompatibility:
    """One reason why a schema change breaks readers.

    ``reader`` and ``writer`` name the schema versions (``v3 (code)``, ``v2``); ``location`` is
    a path in the reader schema such as ``/fields/2/type``.
    """

    event_type: str
    reader: str
    writer: str
    kind: str
    location: str
    message: str

    def __str__(self) -> str:
        return (
            f"{self.event_type}: {self.reader} cannot read {self.writer}: "
            f"{self.kind} at {self.location}: {self.message}"
        )


def incompatibilities(
    *, reader: dict[str, Any], writer: dict[str, Any], mode: str | None = None
) -> list[tuple[str, str, str]]:
    """Return why ``reader`` cannot read data written with ``writer``, as (kind, location,
    message) triples; empty when it can.

    Besides the Avro checker's findings: ``logical_type_mismatch`` where the same data has
    different logical types on each side (one of them may have none), ``decimal_mismatch``
    where decimals differ in precision or scale. Their message names the field path (such as
    ``lines[].at``), both sides' types and, when given, ``mode`` (``BACKWARD_TRANSITIVE``).
    """
    reader_schema, writer_schema = _parse(reader), _parse(writer)
    found = _explain(reader_schema, writer_schema, "")
    found.extend(_logical_mismatches(reader_schema, writer_schema, "", "", mode))
    return found


def check_compatibility(
    event_types: Iterable[EventType[Any]],
    catalog: SchemaCatalog,
    *,
    mode: CompatibilityMode,
    transitive: bool = False,
) -> list[Incompatibility]:
    """Check each event type's code schema against its committed versions in ``catalog``.

    Returns every incompatibility found (empty: the change is safe in ``mode``). Event types
    without committed versions have nothing to break.
    """
    found: list[Incompatibility] = []
    label = f"{mode.value}_TRANSITIVE" if transitive else mode.value
    for event_type in event_types:
        code = SchemaEntry.of(event_type)
        committed = catalog.versions(event_type.name)
        found.extend(_version_problems(code, committed))
        older = [entry for entry in committed if entry.version < code.version]
        for old in older if transitive else older[-1:]:
            pairs = []
            if mode in (CompatibilityMode.BACKWARD, CompatibilityMode.FULL):
                pairs.append((code, old))
            if mode in (CompatibilityMode.FORWARD, CompatibilityMode.FULL):
                pairs.append((old, code))
            for reader, writer in pairs:
                found.extend(
                    _incompatibility(reader, writer, *problem)
                    for problem in incompatibilities(
                        reader=reader.schema, writer=writer.schema, mode=label
                    )
                )
    return found


def _version_problems(code: SchemaEntry, committed: list[SchemaEntry]) -> list[Incompatibility]:
    problems = []
    for entry in committed:
        if entry.version == code.version and entry.fingerprint != code.fingerprint:
            message = (
                f"{entry.describe()} is committed with other content; "
                "a changed schema needs a new version"
            )
            problems.append(
                _incompatibility(code, entry, "committed_version_changed", "/", message)
            )
        if entry.version > code.version:
            message = f"{entry.describe()} is newer than the code's version {code.version}"
            problems.append(_incompatibility(code, entry, "committed_version_newer", "/", message))
    return problems


def _incompatibility(
    reader: SchemaEntry, writer: SchemaEntry, kind: str, location: str, message: str
) -> Incompatibility:
    """The :class:`Incompatibility` of ``reader``'s event type, naming both versions."""
    return Incompatibility(
        event_type=reader.event_type,
        reader=_label(reader),
        writer=_label(writer),
        kind=kind,
        location=location,
        message=message,
    )


def _label(entry: SchemaEntry) -> str:
    return f"v{entry.version}" + (" (code)" if entry.source is None else "")


def _parse(schema: dict[str, Any]) -> Schema:
    # The avro package knows only some logical types and warns about the others (such as
    # local-timestamp-millis): they are checked here, by name, whatever it knows.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredLogicalType)
        return parse(json.dumps(schema))


def _explain(reader: Schema, writer: Schema, location: str) -> list[tuple[str, str, str]]:
    """Ask the Avro checker; split a record's several problems into one per field."""
    checker = ReaderWriterCompatibilityChecker()  # type: ignore[no-untyped-call]  # avro's own
    result = checker.get_compatibility(reader, writer)
    if result.compatibility is not SchemaCompatibilityType.incompatible:
        return []
    several = len(result.incompatibilities) > 1
    if several and isinstance(reader, RecordSchema) and isinstance(writer, RecordSchema):
        per_field = _explain_fields(reader, writer, location)
        if len(per_field) == len(result.incompatibilities):
            return per_field
    return [_summary(result, location)]


def _explain_fields(
    reader: RecordSchema, writer: RecordSchema, location: str
) -> list[tuple[str, str, str]]:
    found = []
    for index, field in enumerate(reader.fields):
        field_location = f"{location}/fields/{index}"
        writer_field = lookup_writer_field(writer_schema=writer, reader_field=field)
        if writer_field is None:
            if not field.has_default:
                found.append(("reader_field_missing_default_value", field_location, field.name))
        else:
            found.extend(_explain(field.type, writer_field.type, f"{field_location}/type"))
    return found


def _summary(result: SchemaCompatibilityResult, location: str) -> tuple[str, str, str]:
    kinds = ", ".join(sorted({kind.value for kind in result.incompatibilities}))
    # The checker may add its root "/" when merging; a deeper location is the informative one.
    places = sorted(result.locations - {"/"}) or ["/"]
    where = ", ".join((location + place if place != "/" else location) or "/" for place in places)
    return kinds, where, "; ".join(sorted(result.messages))


#: The logical types of the Avro specification (1.12) and the types that may carry them; a
#: logical type on any other type is ignored, as the specification says readers must.
_LOGICAL_TYPES: dict[str, frozenset[str]] = {
    "decimal": frozenset({"bytes", "fixed"}),
    "big-decimal": frozenset({"bytes"}),
    "uuid": frozenset({"string", "fixed"}),
    "date": frozenset({"int"}),
    "time-millis": frozenset({"int"}),
    "time-micros": frozenset({"long"}),
    "timestamp-millis": frozenset({"long"}),
    "timestamp-micros": frozenset({"long"}),
    "timestamp-nanos": frozenset({"long"}),
    "local-timestamp-millis": frozenset({"long"}),
    "local-timestamp-micros": frozenset({"long"}),
    "local-timestamp-nanos": frozenset({"long"}),
    "duration": frozenset({"fixed"}),
}
_FIXED_SIZES = {"uuid": 16, "duration": 12}


def _logical_mismatches(
    reader: Schema,
    writer: Schema,
    location: str,
    path: str,
    mode: str | None,
    seen: set[tuple[int, int]] | None = None,
) -> list[tuple[str, str, str]]:
    """Where the reader and writer give the same data different logical types (Avro's checker
    compares only the underlying types: ``timestamp-millis`` read as ``timestamp-micros`` is
    a 1000x error, a plain ``string`` read as ``uuid`` fails on the first non-UUID value).

    Walks the pairs of sub-schemas that read each other (fields, items, values, the union
    branch Avro's resolution picks); a pair the Avro checker already rejects is not reported
    again. Decimals must also agree on precision and scale (Avro specification).
    """
    seen = set() if seen is None else seen
    if (id(reader), id(writer)) in seen:
        return []
    seen.add((id(reader), id(writer)))
    reader_logical, writer_logical = _logical(reader), _logical(writer)
    unions = isinstance(reader, UnionSchema) or isinstance(writer, UnionSchema)
    if (reader_logical or writer_logical) and not unions and _readable(reader, writer):
        field = path.removeprefix(".") or "(root)"
        where = f"field {field}: reader {_describe(reader)}, writer {_describe(writer)}"
        suffix = f" in {mode} mode" if mode else ""
        if reader_logical != writer_logical:
            return [("logical_type_mismatch", location or "/", where + suffix)]
        if reader_logical == "decimal" and _decimal(reader) != _decimal(writer):
            return [("decimal_mismatch", location or "/", where + suffix)]
    found: list[tuple[str, str, str]] = []
    for reader_child, writer_child, step, name in _children(reader, writer):
        found.extend(
            _logical_mismatches(
                reader_child, writer_child, location + step, path + name, mode, seen
            )
        )
    return found


def _logical(schema: Schema) -> str | None:
    """The logical type ``schema`` carries, or ``None`` (none, unknown, or on a wrong type)."""
    logical = schema.get_prop("logicalType")
    if not isinstance(logical, str) or schema.type not in _LOGICAL_TYPES.get(logical, ()):
        return None
    size = _FIXED_SIZES.get(logical)
    if schema.type == "fixed" and size is not None and schema.get_prop("size") != size:
        return None
    return logical


def _decimal(schema: Schema) -> tuple[object, object]:
    return schema.get_prop("precision"), schema.get_prop("scale") or 0


def _describe(schema: Schema) -> str:
    """``timestamp-millis (long)``, ``decimal(precision=18, scale=2) (bytes)``, ``string``
    (no logical type)."""
    logical = _logical(schema)
    if logical is None:
        return f"{schema.type} (no logical type)"
    if logical == "decimal":
        precision, scale = _decimal(schema)
        logical = f"decimal(precision={precision}, scale={scale})"
    return f"{logical} ({schema.type})"


def _readable(reader: Schema, writer: Schema) -> bool:
    checker = ReaderWriterCompatibilityChecker()  # type: ignore[no-untyped-call]  # avro's own
    result = checker.get_compatibility(reader, writer)
    return result.compatibility is not SchemaCompatibilityType.incompatible


def _children(reader: Schema, writer: Schema) -> list[tuple[Schema, Schema, str, str]]:
    """The pairs of sub-schemas that read each other's data: same field, items, values, or
    the reader's union branch that Avro's resolution picks for each writer branch. Each pair
    comes with its step in the reader schema's location and in the field path."""
    if isinstance(reader, RecordSchema) and isinstance(writer, RecordSchema):
        pairs = []
        for index, field in enumerate(reader.fields):
            writer_field = lookup_writer_field(writer_schema=writer, reader_field=field)
            if writer_field is not None:
                pairs.append(
                    (field.type, writer_field.type, f"/fields/{index}/type", f".{field.name}")
                )
        return pairs
    if isinstance(reader, ArraySchema) and isinstance(writer, ArraySchema):
        return [(reader.items, writer.items, "/items", "[]")]
    if isinstance(reader, MapSchema) and isinstance(writer, MapSchema):
        return [(reader.values, writer.values, "/values", "{}")]
    if not isinstance(reader, UnionSchema) and not isinstance(writer, UnionSchema):
        return []
    writer_branches = writer.schemas if isinstance(writer, UnionSchema) else [writer]
    pairs = []
    for writer_branch in writer_branches:
        if not isinstance(reader, UnionSchema):
            pairs.append((reader, writer_branch, "", ""))
            continue
        picked = _resolve_branch(reader.schemas, writer_branch)
        if picked is not None:
            pairs.append((reader.schemas[picked], writer_branch, f"/{picked}", ""))
    return pairs


def _resolve_branch(branches: list[Schema], writer: Schema) -> int | None:
    """The reader union branch Avro resolves ``writer`` to: the first of the same type (and
    name, for named types), else the first that can read it (a promotion such as int to long).
    """
    writer_name = getattr(writer, "fullname", None)
    for index, branch in enumerate(branches):
        if branch.type == writer.type and getattr(branch, "fullname", None) == writer_name:
            return index
    for index, branch in enumerate(branches):
        if _readable(branch, writer):
            return index
    return None
