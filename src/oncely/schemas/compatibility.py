"""Schema evolution rules: is the code's schema compatible with the committed versions?

Built on Apache Avro's ``avro.compatibility.ReaderWriterCompatibilityChecker`` (can a reader
schema read what a writer schema wrote?), composed into the schema registry's modes:

* ``BACKWARD``: the code's schema reads data written with the committed versions;
* ``FORWARD``: the committed versions read data written with the code's schema;
* ``FULL``: both.

Non-transitive checks compare with the latest committed version older than the code's;
transitive checks compare with every older one. A committed file of the code's own version
must hold the code's schema (committed versions never change), and no committed version may
be newer than the code's. The Avro checker ignores logical types; decimal precision and scale
are compared here as well, since a changed scale silently rescales every value.
"""

from __future__ import annotations

import json
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
    *, reader: dict[str, Any], writer: dict[str, Any]
) -> list[tuple[str, str, str]]:
    """Return why ``reader`` cannot read data written with ``writer``, as (kind, location,
    message) triples; empty when it can."""
    reader_schema, writer_schema = _parse(reader), _parse(writer)
    found = _explain(reader_schema, writer_schema, "")
    found.extend(_decimal_mismatches(reader_schema, writer_schema, ""))
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
                    Incompatibility(
                        event_type=event_type.name,
                        reader=_label(reader),
                        writer=_label(writer),
                        kind=kind,
                        location=location,
                        message=message,
                    )
                    for kind, location, message in incompatibilities(
                        reader=reader.schema, writer=writer.schema
                    )
                )
    return found


def _version_problems(code: SchemaEntry, committed: list[SchemaEntry]) -> list[Incompatibility]:
    problems = []
    for entry in committed:
        if entry.version == code.version and entry.fingerprint != code.fingerprint:
            problems.append(
                Incompatibility(
                    event_type=code.event_type,
                    reader=_label(code),
                    writer=_label(entry),
                    kind="committed_version_changed",
                    location="/",
                    message=f"{entry.describe()} is committed with other content; "
                    "a changed schema needs a new version",
                )
            )
        if entry.version > code.version:
            problems.append(
                Incompatibility(
                    event_type=code.event_type,
                    reader=_label(code),
                    writer=_label(entry),
                    kind="committed_version_newer",
                    location="/",
                    message=f"{entry.describe()} is newer than the code's version {code.version}",
                )
            )
    return problems


def _label(entry: SchemaEntry) -> str:
    return f"v{entry.version}" + (" (code)" if entry.source is None else "")


def _parse(schema: dict[str, Any]) -> Schema:
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


def _decimal_mismatches(
    reader: Schema, writer: Schema, location: str, seen: set[tuple[int, int]] | None = None
) -> list[tuple[str, str, str]]:
    """Decimals at the same place must have the same precision and scale (Avro spec)."""
    seen = set() if seen is None else seen
    if (id(reader), id(writer)) in seen:
        return []
    seen.add((id(reader), id(writer)))
    reader_decimal, writer_decimal = _decimal(reader), _decimal(writer)
    if reader_decimal and writer_decimal and reader_decimal != writer_decimal:
        return [
            (
                "decimal_mismatch",
                location or "/",
                f"reader decimal(precision={reader_decimal[0]}, scale={reader_decimal[1]}) "
                f"differs from writer decimal(precision={writer_decimal[0]}, "
                f"scale={writer_decimal[1]})",
            )
        ]
    found: list[tuple[str, str, str]] = []
    for reader_child, writer_child, step in _children(reader, writer):
        found.extend(_decimal_mismatches(reader_child, writer_child, location + step, seen))
    return found


def _decimal(schema: Schema) -> tuple[int, int] | None:
    if schema.get_prop("logicalType") != "decimal":
        return None
    precision, scale = schema.get_prop("precision"), schema.get_prop("scale") or 0
    return (precision, scale) if isinstance(precision, int) and isinstance(scale, int) else None


def _children(reader: Schema, writer: Schema) -> list[tuple[Schema, Schema, str]]:
    """The pairs of sub-schemas that read each other's data: same field, items, values, or
    union branches of the same type."""
    if isinstance(reader, RecordSchema) and isinstance(writer, RecordSchema):
        pairs = []
        for index, field in enumerate(reader.fields):
            writer_field = lookup_writer_field(writer_schema=writer, reader_field=field)
            if writer_field is not None:
                pairs.append((field.type, writer_field.type, f"/fields/{index}/type"))
        return pairs
    if isinstance(reader, ArraySchema) and isinstance(writer, ArraySchema):
        return [(reader.items, writer.items, "/items")]
    if isinstance(reader, MapSchema) and isinstance(writer, MapSchema):
        return [(reader.values, writer.values, "/values")]
    reader_branches = reader.schemas if isinstance(reader, UnionSchema) else [reader]
    writer_branches = writer.schemas if isinstance(writer, UnionSchema) else [writer]
    if len(reader_branches) == len(writer_branches) == 1:
        return []
    return [
        (reader_branch, writer_branch, f"/{index}")
        for index, reader_branch in enumerate(reader_branches)
        for writer_branch in writer_branches
        if reader_branch.type == writer_branch.type
    ]
