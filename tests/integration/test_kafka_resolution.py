"""The broker's classpath is resolved from the shipped pom every run (never only from a cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncely.devstack import DEFAULT_KAFKA_VERSION, resolve_kafka_libs

pytestmark = pytest.mark.integration


def test_maven_resolves_the_broker_and_a_logging_binding(tmp_path: Path) -> None:
    libs = resolve_kafka_libs(DEFAULT_KAFKA_VERSION, cache_dir=tmp_path)
    jars = {path.name for path in libs.glob("*.jar")}
    assert f"kafka_2.13-{DEFAULT_KAFKA_VERSION}.jar" in jars
    assert f"kafka-clients-{DEFAULT_KAFKA_VERSION}.jar" in jars
    # Without an SLF4J binding the broker would log nothing.
    assert any(name.startswith("log4j-slf4j") for name in jars)
    assert (tmp_path / f"kafka-{DEFAULT_KAFKA_VERSION}" / ".resolved").exists()
    # A completed resolution is reused as is.
    assert resolve_kafka_libs(DEFAULT_KAFKA_VERSION, cache_dir=tmp_path) == libs
