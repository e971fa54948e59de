"""The shape of docker-compose.yml and the Dockerfile; tests/container runs them with podman."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

from oncely.debezium import ConnectorOptions, render
from oncely.devstack.connect import DEFAULT_DEBEZIUM_VERSION

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _image(service: dict[str, Any], variable: str) -> str:
    """The service's image by default: ``${VARIABLE:-default}`` lets the podman path swap it."""
    match = re.fullmatch(r"\$\{(\w+):-([^}]+)\}", service["image"])
    assert match, service["image"]
    assert match.group(1) == variable
    return match.group(2)


def test_compose_runs_postgres_with_logical_wal_and_a_kraft_broker() -> None:
    services = _compose()["services"]
    postgres, kafka = services["postgres"], services["kafka"]
    assert _image(postgres, "ONCELY_POSTGRES_IMAGE").startswith("postgres:")
    assert "wal_level=logical" in postgres["command"]
    # Host ports 5432 and 9092 by default, others by ONCELY_POSTGRES_PORT and ONCELY_KAFKA_PORT.
    assert "${ONCELY_POSTGRES_PORT:-5432}:5432" in postgres["ports"]
    assert _image(kafka, "ONCELY_KAFKA_IMAGE").startswith("apache/kafka:4.")
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert "HOST://127.0.0.1:${ONCELY_KAFKA_PORT:-9092}" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "${ONCELY_KAFKA_PORT:-9092}:9092" in kafka["ports"]
    # The services needed to develop against are not behind a profile.
    assert "profiles" not in postgres and "profiles" not in kafka


def test_compose_pipeline_services_read_oncely_settings_from_the_network() -> None:
    services = _compose()["services"]
    for name in ("migrate", "topics", "relay", "consumer", "send-receipt", "task-worker"):
        service = services[name]
        assert "pipeline" in service["profiles"]
        env = service["environment"]
        assert env["ONCELY_KAFKA_BOOTSTRAP_SERVERS"] == "kafka:29092"
        assert "@postgres:5432/" in env["ONCELY_DATABASE_URL"]
        assert env["ONCELY_DATABASE_URL"].startswith("postgresql+psycopg://")
    for name in ("relay", "consumer", "send-receipt", "task-worker"):
        # Every process starts after the tables and topics exist.
        conditions = {k: v["condition"] for k, v in services[name]["depends_on"].items()}
        assert conditions == {
            "migrate": "service_completed_successfully",
            "topics": "service_completed_successfully",
        }
    for name in ("migrate", "topics", "relay", "consumer", "send-receipt", "task-worker"):
        service = services[name]
        # One image, built from the Dockerfile by whichever service comes first, run read-only.
        assert _image(service, "ONCELY_IMAGE") == "oncely:dev"
        assert service["build"]["context"] == "."
        assert service["read_only"] is True
        # The app comes from ONCELY_APP: no positional module:attribute, no --registry.
        assert service["environment"]["ONCELY_APP"] == "examples.payments.app:app"
        assert not any(":" in word or word == "--registry" for word in service["command"])
    assert services["migrate"]["command"] == ["db", "upgrade"]
    # The relay's SIGTERM drain takes up to 30 s: Docker must not SIGKILL it first.
    assert services["relay"]["stop_grace_period"] == "45s"
    assert services["relay"]["command"][:2] == ["relay", "run"]
    assert services["connect"]["profiles"] == ["debezium"]


def test_compose_connect_service_runs_debezium_with_the_generated_connector_config() -> None:
    services = _compose()["services"]
    connect = services["connect"]
    # Debezium mode replaces the relay: never in the same profile.
    assert "debezium" not in services["relay"]["profiles"]
    assert _image(connect, "ONCELY_CONNECT_IMAGE") == (
        f"quay.io/debezium/connect:{DEFAULT_DEBEZIUM_VERSION}"
    )
    assert connect["environment"]["BOOTSTRAP_SERVERS"] == "kafka:29092"
    assert set(connect["depends_on"]) == {"postgres", "kafka"}
    assert "./deploy/debezium:/oncely/debezium:ro" in connect["volumes"]
    # The mounted file is what `oncely debezium config` prints for the compose database.
    pg = services["postgres"]["environment"]
    url = (
        f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}"
        f"@postgres:5432/{pg['POSTGRES_DB']}"
    )
    expected = render(ConnectorOptions.from_database_url(url), "json")
    assert (ROOT / "deploy" / "debezium" / "oncely-outbox.json").read_text() == expected


def test_dockerfile_image_runs_the_oncely_cli_as_a_non_root_user() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    instructions = [(item["instruction"], item["value"]) for item in parser.structure]
    entrypoints = [value for name, value in instructions if name == "ENTRYPOINT"]
    assert [json.loads(value) for value in entrypoints] == [["oncely"]]
    users = [value for name, value in instructions if name == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    # A numeric user, so that Kubernetes' runAsNonRoot can verify it.
    assert users[-1].split(":")[0].isdigit()
    for name, value in instructions:
        if name == "COPY" and "--from" not in value:
            *sources, _dest = value.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY source {source} is missing"


def test_dockerfile_pins_its_base_labels_its_version_and_checks_health() -> None:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    # The default base is a public image pinned to a patch release.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", parser.baseimage)
    with (ROOT / "pyproject.toml").open("rb") as file:
        version = tomllib.load(file)["project"]["version"]
    assert parser.labels["org.opencontainers.image.version"] == version
    assert "org.opencontainers.image.source" in parser.labels
    checks = [i["value"] for i in parser.structure if i["instruction"] == "HEALTHCHECK"]
    assert len(checks) == 1
    assert checks[0].endswith('CMD ["oncely", "healthcheck"]')
