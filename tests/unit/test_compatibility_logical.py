"""Logical types in the compatibility gate: the Avro checker compares only underlying types.

Every ordered pair of schemas below that Avro's checker accepts (the same underlying type or
a promotion) but that differs in logical type (or in decimal precision or scale) must be
reported, with the field path, both sides' types and the mode; equal ones must not.
"""

from __future__ import annotations

import copy
import json
import warnings
from datetime import date, datetime
from itertools import product
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType
from avro.errors import IgnoredLogicalType
from avro.schema import parse
from pydantic import BaseModel

from oncely.events import Registry
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry
from oncely.schemas.compatibility import CompatibilityMode, check_compatibility, incompatibilities

UNITS = ("millis", "micros", "nanos")

#: The timestamp logical types, all on long.
TIMESTAMPS = [f"{local}timestamp-{unit}" for local in ("", "local-") for unit in UNITS]


def _fixed(size: int, **props: Any) -> dict[str, Any]:
    return {"type": "fixed", "name": "F", "size": size, **props}


def _logical(underlying: str, logical: str) -> tuple[dict[str, Any], str]:
    """``logical`` on ``underlying`` and how the gate describes it."""
    return {"type": underlying, "logicalType": logical}, f"{logical} ({underlying})"


def _decimal(precision: int, scale: int) -> tuple[dict[str, Any], str]:
    schema = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    return schema, f"decimal(precision={precision}, scale={scale}) (bytes)"


#: label -> (schema, how the gate describes it). The label also names the logical type (and
#: decimal precision and scale): two schemas with the same label must be compatible.
VARIANTS: dict[str, tuple[Any, str]] = {
    "int": ("int", "int (no logical type)"),
    "long": ("long", "long (no logical type)"),
    "string": ("string", "string (no logical type)"),
    "bytes": ("bytes", "bytes (no logical type)"),
    "fixed12": (_fixed(12), "fixed (no logical type)"),
    "fixed16": (_fixed(16), "fixed (no logical type)"),
    "decimal(4,2)": _decimal(4, 2),
    "decimal(5,2)": _decimal(5, 2),
    "decimal(4,3)": _decimal(4, 3),
    "fixed-decimal(4,2)": (
        _fixed(12, logicalType="decimal", precision=4, scale=2),
        "decimal(precision=4, scale=2) (fixed)",
    ),
    "big-decimal": _logical("bytes", "big-decimal"),
    "uuid": _logical("string", "uuid"),
    "fixed-uuid": (_fixed(16, logicalType="uuid"), "uuid (fixed)"),
    "date": _logical("int", "date"),
    "time-millis": _logical("int", "time-millis"),
    "time-micros": _logical("long", "time-micros"),
    **{name: _logical("long", name) for name in TIMESTAMPS},
    "duration": (_fixed(12, logicalType="duration"), "duration (fixed)"),
}
PLAIN = {"int", "long", "string", "bytes", "fixed12", "fixed16"}


def _record(field_type: Any) -> dict[str, Any]:
    return {"type": "record", "name": "r", "fields": [{"name": "at", "type": field_type}]}


def _avro_accepts(reader: Any, writer: Any) -> bool:
    checker = ReaderWriterCompatibilityChecker()  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():  # avro does not know some logical types: plain for it
        warnings.simplefilter("ignore", IgnoredLogicalType)
        parsed = [parse(json.dumps(_record(schema))) for schema in (reader, writer)]
    result = checker.get_compatibility(*parsed)
    return result.compatibility is SchemaCompatibilityType.compatible


#: Every ordered pair with a logical type on at least one side that Avro's checker accepts.
PAIRS = [
    (reader, writer)
    for reader, writer in product(VARIANTS, VARIANTS)
    if not (reader in PLAIN and writer in PLAIN)
    and _avro_accepts(VARIANTS[reader][0], VARIANTS[writer][0])
]


def test_the_pairs_cover_every_logical_type_against_its_plain_type() -> None:
    # The checker accepts what the gate must refuse: each logical type on either side.
    logical = set(VARIANTS) - PLAIN
    assert logical <= {r for r, w in PAIRS if r != w}
    assert logical <= {w for r, w in PAIRS if r != w}
    assert ("timestamp-micros", "timestamp-millis") in PAIRS
    assert ("uuid", "string") in PAIRS and ("string", "uuid") in PAIRS
    assert ("date", "int") in PAIRS and ("time-micros", "time-millis") in PAIRS


@pytest.mark.parametrize(("reader", "writer"), PAIRS, ids=[f"{r}<-{w}" for r, w in PAIRS])
def test_logical_type_pair(reader: str, writer: str) -> None:
    reader_schema, reader_text = VARIANTS[reader]
    writer_schema, writer_text = VARIANTS[writer]
    found = incompatibilities(
        reader=_record(reader_schema), writer=_record(writer_schema), mode="FULL"
    )
    if reader == writer:
        assert found == []
        return
    assert len(found) == 1, f"expected one mismatch, found {found}"
    [(kind, location, message)] = found
    both_decimal = reader.startswith("decimal") and writer.startswith("decimal")
    assert kind == ("decimal_mismatch" if both_decimal else "logical_type_mismatch")
    assert location == "/fields/0/type"
    assert message == f"field at: reader {reader_text}, writer {writer_text} in FULL mode"


def test_a_logical_type_on_a_type_that_cannot_carry_it_is_ignored() -> None:
    # The specification: such a logicalType is ignored, the schema is its plain type.
    wrong = {"type": "string", "logicalType": "timestamp-millis"}
    assert incompatibilities(reader=_record(wrong), writer=_record("string")) == []
    wrong_size = _fixed(8, logicalType="duration")
    assert incompatibilities(reader=_record(wrong_size), writer=_record(_fixed(8))) == []


def _array(items: Any) -> dict[str, Any]:
    return {"type": "array", "items": items}


def _map(values: Any) -> dict[str, Any]:
    return {"type": "map", "values": values}


MILLIS = {"type": "long", "logicalType": "timestamp-millis"}
MICROS = {"type": "long", "logicalType": "timestamp-micros"}


@pytest.mark.parametrize(
    ("reader_type", "writer_type", "location", "path"),
    [
        pytest.param(_array(MICROS), _array(MILLIS), "/fields/0/type/items", "at[]", id="array"),
        pytest.param(_map(MICROS), _map(MILLIS), "/fields/0/type/values", "at{}", id="map"),
        pytest.param(["null", MICROS], ["null", MILLIS], "/fields/0/type/1", "at", id="union"),
        pytest.param(["null", MICROS], MILLIS, "/fields/0/type/1", "at", id="to-union"),
        pytest.param(MICROS, [MILLIS], "/fields/0/type", "at", id="from-union"),
        pytest.param(
            ["null", "string", MICROS],
            ["null", {"type": "int", "logicalType": "date"}],
            "/fields/0/type/2",
            "at",
            id="union-promotion",
        ),
        pytest.param(
            _record(["null", _array(_record(MICROS) | {"name": "l"})]) | {"name": "m"},
            _record(["null", _array(_record(MILLIS) | {"name": "l"})]) | {"name": "m"},
            "/fields/0/type/fields/0/type/1/items/fields/0/type",
            "at.at[].at",
            id="nested",
        ),
    ],
)
def test_logical_types_are_compared_inside_containers(
    reader_type: Any, writer_type: Any, location: str, path: str
) -> None:
    [(kind, where, message)] = incompatibilities(
        reader=_record(reader_type), writer=_record(writer_type)
    )
    assert (kind, where) == ("logical_type_mismatch", location)
    assert message.startswith(f"field {path}: reader timestamp-micros (long), writer ")


class Event(BaseModel):
    id: UUID
    at: datetime
    day: date


def _changed(schema: dict[str, Any], field: str, logical: str) -> dict[str, Any]:
    changed = copy.deepcopy(schema)
    [spec] = [f for f in changed["fields"] if f["name"] == field]
    spec["type"] = {**spec["type"], "logicalType": logical}
    return changed


def _committed(version: int, schema: dict[str, Any]) -> SchemaEntry:
    return SchemaEntry(
        "t.e", version, schema, bytes([version]) * 8, source=Path(f"v{version}.avsc")
    )


MODES = [
    (CompatibilityMode.BACKWARD, False, ["v3 (code) cannot read v2"]),
    (CompatibilityMode.FORWARD, False, ["v2 cannot read v3 (code)"]),
    (CompatibilityMode.FULL, False, ["v3 (code) cannot read v2", "v2 cannot read v3 (code)"]),
    (
        CompatibilityMode.BACKWARD,
        True,
        ["v3 (code) cannot read v1", "v3 (code) cannot read v2"],
    ),
    (CompatibilityMode.FORWARD, True, ["v1 cannot read v3 (code)", "v2 cannot read v3 (code)"]),
    (
        CompatibilityMode.FULL,
        True,
        [
            "v3 (code) cannot read v1",
            "v1 cannot read v3 (code)",
            "v3 (code) cannot read v2",
            "v2 cannot read v3 (code)",
        ],
    ),
]


@pytest.mark.parametrize(
    ("mode", "transitive", "expected"),
    MODES,
    ids=[f"{m.value}{'_TRANSITIVE' if t else ''}" for m, t, _ in MODES],
)
def test_every_mode_reports_the_logical_type_change(
    mode: CompatibilityMode, transitive: bool, expected: list[str]
) -> None:
    # v1 and v2 were written with timestamp-millis; the code (v3) says timestamp-micros.
    registry = Registry()
    code = SchemaEntry.of(registry.register(Event, name="t.e", key="id", aggregate="t", version=3))
    millis = _changed(code.schema, "at", "timestamp-millis")
    catalog = SchemaCatalog([_committed(1, millis), _committed(2, millis)])
    found = check_compatibility(registry, catalog, mode=mode, transitive=transitive)
    label = mode.value + ("_TRANSITIVE" if transitive else "")
    assert [f"{p.reader} cannot read {p.writer}" for p in found] == expected
    for problem in found:
        assert problem.kind == "logical_type_mismatch"
        reader, writer = (
            ("timestamp-micros", "timestamp-millis")
            if problem.reader == "v3 (code)"
            else ("timestamp-millis", "timestamp-micros")
        )
        assert problem.message == (
            f"field at: reader {reader} (long), writer {writer} (long) in {label} mode"
        )


def test_a_uuid_field_that_was_a_plain_string_is_a_break() -> None:
    registry = Registry()
    code = SchemaEntry.of(registry.register(Event, name="t.e", key="id", aggregate="t", version=2))
    plain = copy.deepcopy(code.schema)
    [spec] = [f for f in plain["fields"] if f["name"] == "id"]
    spec["type"] = "string"
    catalog = SchemaCatalog([_committed(1, plain)])
    [problem] = check_compatibility(registry, catalog, mode=CompatibilityMode.BACKWARD)
    assert str(problem).endswith(
        "logical_type_mismatch at /fields/0/type: field id: reader uuid (string), "
        "writer string (no logical type) in BACKWARD mode"
    )
