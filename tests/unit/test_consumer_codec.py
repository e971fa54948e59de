"""The codec consumers build: the committed catalog (option, env, ./schemas) and the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncely.errors import ConfigurationError
from oncely.schemas.catalog import export_schemas
from oncely.schemas.codec import Codec
from oncely.schemas.errors import CatalogError, DecodeError, DecodeFailure
from oncely.schemas.loader import codec_for, find_catalog
from oncely.settings import SchemaSettings
from tests.apps.orders import build
from tests.helpers import oncely_cli

V1, V2 = build("unit.")


def test_without_a_folder_the_catalog_is_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    catalog = find_catalog(None)
    assert len(catalog) == 0 and catalog.directory is None


def test_schemas_in_the_working_directory_are_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export_schemas(V1.registry, tmp_path / "schemas")
    monkeypatch.chdir(tmp_path)
    catalog = find_catalog(None)
    assert catalog.directory == (tmp_path / "schemas").absolute()
    assert [(e.event_type, e.version) for e in catalog] == [("order.placed", 1)]


def test_the_settings_name_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    export_schemas(V1.registry, tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ONCELY_SCHEMAS_DIR", str(tmp_path / "elsewhere"))
    value, headers = Codec(registry=V1.registry).encode(V1.model(order_id="o-1", amount=3))
    event = codec_for(V2.registry).decode(value, headers, expected=V2.model)
    assert event == V2.model(order_id="o-1", amount=3, currency="EUR")


def test_a_missing_folder_given_explicitly_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="nowhere does not exist: give the folder"):
        codec_for(V2.registry, SchemaSettings(schemas_dir=tmp_path / "nowhere"))


def test_an_unknown_writer_names_the_type_the_fingerprint_and_the_folder(tmp_path: Path) -> None:
    export_schemas(V1.registry, tmp_path)
    value, headers = Codec(registry=V2.registry).encode(V2.model(order_id="o-1", amount=3))
    codec = codec_for(V1.registry, SchemaSettings(schemas_dir=tmp_path))
    with pytest.raises(DecodeError) as caught:
        codec.decode(value, headers, expected=V1.model)
    assert caught.value.reason is DecodeFailure.UNKNOWN_SCHEMA
    message = str(caught.value)
    assert "'order.placed'" in message
    assert V2.registry.get("order.placed").fingerprint.hex() in message
    assert str(tmp_path.absolute()) in message
    assert "oncely schemas export" in message


def test_avro_confluent_values_round_trip_through_the_registry_url() -> None:
    _, v2 = build("unit.", encoding="avro-confluent")
    settings = SchemaSettings(
        schema_registry_url="mock://consumer-codec", schema_registry_auto_register=True
    )
    codec = codec_for(v2.registry, settings)
    value, headers = codec.encode(v2.model(order_id="o-2", amount=5, currency="USD"))
    assert value[0] == 0, "Confluent framing: the schema id comes from the registry"
    assert codec.decode(value, headers, expected=v2.model).currency == "USD"


def test_avro_confluent_without_a_registry_url_names_the_setting() -> None:
    _, v2 = build("unit.", encoding="avro-confluent")
    with pytest.raises(ConfigurationError, match="ONCELY_SCHEMA_REGISTRY_URL"):
        codec_for(v2.registry, SchemaSettings())


def test_consume_refuses_a_missing_catalog_folder_in_one_line(tmp_path: Path) -> None:
    result = oncely_cli(
        "consume", "tests.apps.orders:effects_v2", "--effect", "orders",
        "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "--bootstrap-servers", "127.0.0.1:1", "--schemas-dir", str(tmp_path / "nowhere"),
    )  # fmt: skip
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "nowhere does not exist" in lines[0], result.output
