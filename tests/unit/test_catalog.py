"""The schema catalog: loading the committed files, lookups, and export that never rewrites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from oncely.events import Registry
from oncely.events.canonical import dump_avsc, fingerprint
from oncely.schemas.catalog import FileChange, SchemaCatalog, SchemaEntry, export_schemas
from oncely.schemas.errors import CatalogError, CommittedVersionChangedError


class Thing(BaseModel):
    id: int


class ThingV2(BaseModel):
    id: int
    name: str = ""


def registry_with(model: type[BaseModel], version: int) -> Registry:
    registry = Registry()
    registry.register(model, name="thing.made", key="id", aggregate="thing", version=version)
    return registry


def test_export_then_load_round_trips(tmp_path: Path) -> None:
    registry = registry_with(Thing, 1)
    outcomes = export_schemas(registry, tmp_path)
    path = tmp_path / "thing.made" / "v1.avsc"
    assert outcomes == [(path, FileChange.WRITTEN)]
    assert path.read_text() == dump_avsc(registry.get("thing.made").schema)

    catalog = SchemaCatalog.load(tmp_path)
    entry = catalog.find("thing.made", 1)
    assert entry is not None
    assert entry.schema == registry.get("thing.made").schema
    assert entry.fingerprint == registry.get("thing.made").fingerprint
    assert entry.source == path
    assert catalog.by_fingerprint(entry.fingerprint) is entry
    assert catalog.event_types() == ["thing.made"]
    assert len(catalog) == 1
    assert list(catalog) == [entry]


def test_export_is_idempotent(tmp_path: Path) -> None:
    registry = registry_with(Thing, 1)
    export_schemas(registry, tmp_path)
    assert export_schemas(registry, tmp_path)[0][1] is FileChange.UNCHANGED


def test_export_never_rewrites_a_committed_version(tmp_path: Path) -> None:
    export_schemas(registry_with(Thing, 1), tmp_path)
    before = (tmp_path / "thing.made" / "v1.avsc").read_text()
    with pytest.raises(
        CommittedVersionChangedError, match=r"thing.made/v1.avsc; a changed schema needs a new"
    ) as caught:
        export_schemas(registry_with(ThingV2, 1), tmp_path)
    assert "refusing to rewrite committed schema versions" in str(caught.value)
    assert (tmp_path / "thing.made" / "v1.avsc").read_text() == before


def test_export_writes_nothing_when_any_version_conflicts(tmp_path: Path) -> None:
    export_schemas(registry_with(Thing, 1), tmp_path)
    registry = registry_with(ThingV2, 1)
    registry.register(Thing, name="other.made", key="id", aggregate="other")
    with pytest.raises(CommittedVersionChangedError):
        export_schemas(registry, tmp_path)
    assert not (tmp_path / "other.made").exists()


def test_new_version_is_added_beside_the_old(tmp_path: Path) -> None:
    export_schemas(registry_with(Thing, 1), tmp_path)
    export_schemas(registry_with(ThingV2, 2), tmp_path)
    catalog = SchemaCatalog.load(tmp_path)
    assert [entry.version for entry in catalog.versions("thing.made")] == [1, 2]


def test_versions_sort_numerically(tmp_path: Path) -> None:
    for version in (10, 2, 1):
        path = tmp_path / "t" / f"v{version}.avsc"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"type": "record", "name": f"R{version}", "fields": []}))
    catalog = SchemaCatalog.load(tmp_path)
    assert [entry.version for entry in catalog.versions("t")] == [1, 2, 10]


def test_fingerprint_tie_returns_the_latest_version() -> None:
    schema = {"type": "record", "name": "R", "fields": []}
    old = SchemaEntry("t", 1, schema, fingerprint(schema))
    new = SchemaEntry("t", 2, {**schema, "doc": "only docs changed"}, fingerprint(schema))
    assert SchemaCatalog([new, old]).by_fingerprint(fingerprint(schema)) is new


def test_duplicate_entries_are_refused() -> None:
    schema = {"type": "record", "name": "R", "fields": []}
    entry = SchemaEntry("t", 1, schema, fingerprint(schema))
    with pytest.raises(CatalogError, match=r"t v1 \(code\) duplicates"):
        SchemaCatalog([entry, entry])


def test_lookups_of_missing_entries_return_none() -> None:
    catalog = SchemaCatalog()
    assert catalog.find("t", 1) is None
    assert catalog.by_fingerprint(b"\x00" * 8) is None
    assert catalog.versions("t") == []


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("v1.avsc", "{not json", "not a valid Avro schema"),
        ("v1.avsc", '{"type": "nonsense"}', "not a valid Avro schema"),
        ("V1.avsc", "{}", "schema files are named v<N>.avsc"),
        ("v0.avsc", "{}", "schema files are named v<N>.avsc"),
        ("latest.avsc", "{}", "schema files are named v<N>.avsc"),
    ],
)
def test_malformed_files_are_named(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / "thing.made" / name
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(CatalogError, match=message) as caught:
        SchemaCatalog.load(tmp_path)
    assert str(path) in str(caught.value)


def test_other_files_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("the contract")
    (tmp_path / "thing.made").mkdir()
    (tmp_path / "thing.made" / "notes.txt").write_text("x")
    assert len(SchemaCatalog.load(tmp_path)) == 0


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="does not exist"):
        SchemaCatalog.load(tmp_path / "nowhere")
