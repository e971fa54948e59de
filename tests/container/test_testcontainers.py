"""The pytest plugin's testcontainers path, for real: podman's Docker-compatible API (``podman
system service``) serves testcontainers the local Kafka and PostgreSQL images, and a project's
tests get their fixtures from those containers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from textwrap import dedent

import pytest
from tools.images import KAFKA_IMAGE, POSTGRES_IMAGE, podman_environment

from tests.container.podman import podman, wait_for
from tests.helpers import run_captured

PROJECT_TEST = dedent(
    """
    import uuid

    import psycopg
    from confluent_kafka import Consumer, Producer
    from oncely.testing.services import libpq_dsn


    def test_the_fixtures_come_from_containers(
        oncely_database_url, oncely_kafka_bootstrap, oncely_new_topic, oncely_services
    ):
        assert oncely_services.origin == "testcontainers"
        with psycopg.connect(libpq_dsn(oncely_database_url)) as conn:
            assert conn.execute("SELECT count(*) FROM oncely_outbox").fetchone() == (0,)
        topic = oncely_new_topic(partitions=2)
        producer = Producer({"bootstrap.servers": oncely_kafka_bootstrap})
        producer.produce(topic, key=b"k", value=b"v")
        assert producer.flush(30) == 0
        consumer = Consumer({"bootstrap.servers": oncely_kafka_bootstrap,
                             "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"})
        consumer.subscribe([topic])
        record = None
        for _ in range(60):
            record = consumer.poll(1.0)
            if record is not None and record.error() is None:
                break
        consumer.close()
        assert record is not None and record.value() == b"v"
    """
)


@pytest.fixture
def docker_host(tmp_path: Path) -> Iterator[str]:
    """podman's Docker-compatible API on a socket of this test, stopped afterwards."""
    socket = tmp_path / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{socket}"],
        env=podman_environment(),
    )
    try:
        wait_for("podman's API socket", socket.exists, 30)
        yield f"unix://{socket}"
    finally:
        service.terminate()
        service.wait(30)


@pytest.mark.timeout(600)
def test_the_plugin_takes_its_services_from_testcontainers_through_podman(
    docker_host: str, tmp_path: Path
) -> None:
    for image in (KAFKA_IMAGE, POSTGRES_IMAGE):
        assert podman("image", "exists", image, check=False).returncode == 0, (
            f"no {image}: run `make test-container`, which builds it"
        )
    (tmp_path / "test_project.py").write_text(PROJECT_TEST)
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith("ONCELY_")
    } | {
        "DOCKER_HOST": docker_host,
        "ONCELY_TEST_SERVICES": "testcontainers",
        "ONCELY_TEST_KAFKA_IMAGE": KAFKA_IMAGE,
        "ONCELY_TEST_POSTGRES_IMAGE": POSTGRES_IMAGE,
        # Ryuk, testcontainers' reaper, is an image of its own: the context managers clean up.
        "TESTCONTAINERS_RYUK_DISABLED": "true",
        # This machine is itself a container, which makes testcontainers look for a gateway
        # in a field podman's API does not fill: the mapped ports are on this host.
        "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
        "CONTAINERS_CONF": podman_environment()["CONTAINERS_CONF"],
    }
    project = run_captured(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "oncely.testing",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "test_project.py",
        ],
        cwd=tmp_path,
        env=environment,
        timeout=540,
    )
    assert project.returncode == 0, project.stdout[-4000:] + project.stderr[-2000:]
    assert f"{KAFKA_IMAGE} (testcontainers)" in project.stdout
    leftovers = podman("ps", "--all", "--quiet", "--filter=label=org.testcontainers=true")
    assert leftovers.stdout.split() == []
