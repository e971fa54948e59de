"""Compatibility modes composed from Avro's reader/writer checker."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from oncely.events import Registry
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry
from oncely.schemas.compatibility import CompatibilityMode, check_compatibility, incompatibilities

BACKWARD, FORWARD, FULL = CompatibilityMode


class V1(BaseModel):
    id: int
    name: str


class AddedOptional(BaseModel):
    id: int
    name: str
    note: str | None = None


class AddedRequired(BaseModel):
    id: int
    name: str
    owner: str


class RemovedRequired(BaseModel):
    id: int


class ChangedType(BaseModel):
    id: int
    name: int


def entry(model: type[BaseModel], version: int, *, committed: bool = True) -> SchemaEntry:
    registry = Registry()
    event_type = registry.register(model, name="t.e", key="id", aggregate="t", version=version)
    code = SchemaEntry.of(event_type)
    if not committed:
        return code
    return SchemaEntry("t.e", version, code.schema, code.fingerprint, source=None)


def check(new: type[BaseModel], *old: type[BaseModel], mode: CompatibilityMode,
          transitive: bool = False) -> list[str]:  # fmt: skip
    registry = Registry()
    registry.register(new, name="t.e", key="id", aggregate="t", version=len(old) + 1)
    catalog = SchemaCatalog(entry(model, index + 1) for index, model in enumerate(old))
    found = check_compatibility(registry, catalog, mode=mode, transitive=transitive)
    return [f"{problem.kind} {problem.location}" for problem in found]


@pytest.mark.parametrize(
    ("new", "mode", "expected"),
    [
        (AddedOptional, BACKWARD, []),
        (AddedOptional, FORWARD, []),
        (AddedOptional, FULL, []),
        (AddedRequired, BACKWARD, ["reader_field_missing_default_value /fields/2"]),
        (AddedRequired, FORWARD, []),
        (AddedRequired, FULL, ["reader_field_missing_default_value /fields/2"]),
        (RemovedRequired, BACKWARD, []),
        (RemovedRequired, FORWARD, ["reader_field_missing_default_value /fields/1"]),
        (RemovedRequired, FULL, ["reader_field_missing_default_value /fields/1"]),
        (ChangedType, BACKWARD, ["type_mismatch /fields/1/type"]),
        (ChangedType, FORWARD, ["type_mismatch /fields/1/type"]),
        (ChangedType, FULL, ["type_mismatch /fields/1/type", "type_mismatch /fields/1/type"]),
    ],
)
def test_modes(new: type[BaseModel], mode: CompatibilityMode, expected: list[str]) -> None:
    assert check(new, V1, mode=mode) == expected


def test_several_problems_are_reported_one_per_field() -> None:
    class Both(BaseModel):
        id: str
        name: str
        extra: int

    assert check(Both, V1, mode=BACKWARD) == [
        "type_mismatch /fields/0/type",
        "reader_field_missing_default_value /fields/2",
    ]


def test_incompatibility_text_names_versions_and_location() -> None:
    registry = Registry()
    registry.register(ChangedType, name="t.e", key="id", aggregate="t", version=2)
    [problem] = check_compatibility(registry, SchemaCatalog([entry(V1, 1)]), mode=BACKWARD)
    assert str(problem) == (
        "t.e: v2 (code) cannot read v1 (code): type_mismatch at /fields/1/type: "
        "reader type: long not compatible with writer type: string"
    )


def test_non_transitive_compares_with_the_latest_older_version_only() -> None:
    # v1 -> v2 dropped the required "name"; v3 == v2 is compatible with v2 but not with v1.
    assert check(RemovedRequired, V1, RemovedRequired, mode=FORWARD) == []
    assert check(RemovedRequired, V1, RemovedRequired, mode=FORWARD, transitive=True) == [
        "reader_field_missing_default_value /fields/1"
    ]


def test_changed_committed_version_is_a_break() -> None:
    registry = Registry()
    registry.register(AddedOptional, name="t.e", key="id", aggregate="t", version=1)
    found = check_compatibility(registry, SchemaCatalog([entry(V1, 1)]), mode=BACKWARD)
    assert [problem.kind for problem in found] == ["committed_version_changed"]


def test_committed_version_newer_than_the_code_is_a_break() -> None:
    registry = Registry()
    registry.register(V1, name="t.e", key="id", aggregate="t", version=1)
    catalog = SchemaCatalog([entry(V1, 1), entry(AddedOptional, 2)])
    found = check_compatibility(registry, catalog, mode=BACKWARD)
    assert [problem.kind for problem in found] == ["committed_version_newer"]


def test_unchanged_committed_version_is_fine() -> None:
    assert check(V1, mode=FULL) == []
    registry = Registry()
    registry.register(V1, name="t.e", key="id", aggregate="t", version=1)
    assert check_compatibility(registry, SchemaCatalog([entry(V1, 1)]), mode=FULL) == []


def test_decimal_scale_change_is_a_break_the_avro_checker_misses() -> None:
    class Cents(BaseModel):
        id: int
        amount: Annotated[Decimal, Field(max_digits=18, decimal_places=2)]

    class Mills(BaseModel):
        id: int
        amount: Annotated[Decimal, Field(max_digits=18, decimal_places=3)]

    assert check(Mills, Cents, mode=BACKWARD) == ["decimal_mismatch /fields/1/type"]


def test_decimal_inside_optional_list() -> None:
    reader = {"type": "record", "name": "r", "fields": [{"name": "a", "type": ["null", {
        "type": "array", "items": {"type": "bytes", "logicalType": "decimal", "precision": 4,
                                   "scale": 2}}]}]}  # fmt: skip
    writer = {"type": "record", "name": "r", "fields": [{"name": "a", "type": ["null", {
        "type": "array", "items": {"type": "bytes", "logicalType": "decimal", "precision": 5,
                                   "scale": 2}}]}]}  # fmt: skip
    [(kind, location, message)] = incompatibilities(reader=reader, writer=writer)
    assert (kind, location) == ("decimal_mismatch", "/fields/0/type/1/items")
    assert "precision=4" in message
    assert "precision=5" in message


def test_enum_symbol_removed_breaks_backward() -> None:
    reader = {"type": "enum", "name": "E", "symbols": ["a"]}
    writer = {"type": "enum", "name": "E", "symbols": ["a", "b"]}
    [(kind, location, message)] = incompatibilities(reader=reader, writer=writer)
    assert (kind, location) == ("missing_enum_symbols", "/symbols")
    assert "b" in message


def test_promotion_reads_one_way_only() -> None:
    narrow = {"type": "record", "name": "r", "fields": [{"name": "x", "type": "long"}]}
    wide = {"type": "record", "name": "r", "fields": [{"name": "x", "type": "double"}]}
    assert incompatibilities(reader=wide, writer=narrow) == []
    [(kind, location, _)] = incompatibilities(reader=narrow, writer=wide)
    assert (kind, location) == ("type_mismatch", "/fields/0/type")
