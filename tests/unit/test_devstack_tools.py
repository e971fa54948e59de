"""The devstack's messages when a tool is missing, and its pure helpers."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from oncely.devstack.jvm import check_java
from oncely.devstack.kafka import KafkaNodeConfig, new_cluster_id, resolve_kafka_libs
from oncely.errors import DevstackError, ToolMissingError


def test_missing_java_names_what_to_install_and_the_docker_alternative(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match=r"Java 17\+") as info:
        check_java()
    assert "docker compose up" in str(info.value)
    assert isinstance(info.value, DevstackError)


def test_old_java_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "java"
    fake.write_text("#!/bin/sh\necho 'openjdk version \"11.0.2\" 2019-01-15' >&2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match=r"11\.0\.2"):
        check_java()


def test_missing_maven_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissingError, match="Maven") as info:
        resolve_kafka_libs("4.4.0", cache_dir=tmp_path / "cache")
    assert "docker compose up" in str(info.value)


_RESOLVE = """
import sys, time
from pathlib import Path
from oncely.devstack.jvm import resolve_once
home = Path(sys.argv[1])
log = home / "resolutions"
def resolve():
    with log.open("a") as out:
        out.write("resolved\\n")
    time.sleep(0.5)
    (home / ".resolved").touch()
resolve_once(home, (home / ".resolved").exists, resolve)
"""


def test_two_processes_starting_together_resolve_a_cache_folder_once(tmp_path: Path) -> None:
    home = tmp_path / "kafka-4.4.0"
    started = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(home)]) for _ in range(2)]
    assert [process.wait(30) for process in started] == [0, 0]
    assert (home / "resolutions").read_text().splitlines() == ["resolved"]


def test_cluster_id_is_a_kafka_uuid() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    for cluster_id in ids:
        assert len(cluster_id) == 22 and not cluster_id.startswith("-")
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_server_properties_use_bootstrap_servers_not_voters(tmp_path: Path) -> None:
    # `StorageTool format --standalone` refuses controller.quorum.voters.
    text = KafkaNodeConfig(data_dir=tmp_path, port=1234, controller_port=5678).server_properties()
    assert "controller.quorum.voters" not in text
    assert "controller.quorum.bootstrap.servers=127.0.0.1:5678" in text
    assert "auto.create.topics.enable=false" in text
    assert "advertised.listeners=PLAINTEXT://127.0.0.1:1234" in text
