"""The Kafka Connect devstack's resolution errors and worker properties (no Java needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncely.devstack.connect import resolve_connect, worker_properties
from oncely.errors import DevstackError, ToolMissingError


def test_missing_maven_names_what_to_install_and_the_docker_alternative(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="Maven") as info:
        resolve_connect(cache_dir=tmp_path / "cache")
    assert "--profile debezium" in str(info.value)


def test_a_failed_resolution_carries_mavens_output_and_is_not_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "mvn"
    fake.write_text("#!/bin/sh\necho 'Could not find artifact io.debezium:x' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    cache = tmp_path / "cache"
    with pytest.raises(DevstackError, match="Could not find artifact") as info:
        resolve_connect("4.4.0", "9.9.9.Final", cache_dir=cache)
    assert "debezium-connector-postgres:9.9.9.Final" in str(info.value)
    assert [path.name for path in cache.iterdir()] == [
        "connect-4.4.0-debezium-9.9.9.Final-otel-1.68.0"
    ]
    assert not list(cache.rglob(".resolved"))


def test_worker_properties_keep_offsets_local_and_rest_on_loopback(tmp_path: Path) -> None:
    text = worker_properties(
        bootstrap_servers="127.0.0.1:9092",
        plugin_path=tmp_path / "plugins",
        offsets_file=tmp_path / "offsets",
        rest_port=18083,
    )
    lines = set(text.splitlines())
    assert "listeners=http://127.0.0.1:18083" in lines
    assert f"offset.storage.file.filename={tmp_path / 'offsets'}" in lines
    assert f"plugin.path={tmp_path / 'plugins'}" in lines
    assert "plugin.discovery=service_load" in lines
