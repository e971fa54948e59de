"""docker-compose.yml, as Docker users run it, brought up by podman-compose on local images:
``--profile pipeline`` runs the payments example from oncely's image, events reach their
effects and their task, ``oncely verify`` passes, and ``down`` leaves nothing running;
``--profile debezium`` does the same with Kafka Connect and Debezium in place of the relay.
The host ports are free ones (ONCELY_POSTGRES_PORT, ONCELY_KAFKA_PORT), so a stack of the
user's own on 5432 and 9092 changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import sqlalchemy as sa
from examples.payments.models import metadata
from examples.payments.service import TransferService
from tools.images import CONNECT_IMAGE, KAFKA_IMAGE, POSTGRES_IMAGE, podman_environment

from oncely.devstack._process import free_ports
from tests.container.payments import applied
from tests.container.podman import IMAGE, ROOT, podman, wait_for
from tests.helpers import oncely_process

APP = "examples.payments.app:app"
PROCESSES = ("relay", "consumer", "send-receipt", "task-worker")


class Compose:
    def __init__(self, project: str) -> None:
        self.project = project
        postgres, kafka = free_ports(2)
        self.database_url = f"postgresql+psycopg://oncely:oncely@127.0.0.1:{postgres}/oncely"
        self.bootstrap = f"127.0.0.1:{kafka}"
        self.environment = podman_environment() | {
            "ONCELY_POSTGRES_PORT": str(postgres),
            "ONCELY_KAFKA_PORT": str(kafka),
            "ONCELY_IMAGE": IMAGE,
            "ONCELY_POSTGRES_IMAGE": POSTGRES_IMAGE,
            "ONCELY_KAFKA_IMAGE": KAFKA_IMAGE,
            "ONCELY_CONNECT_IMAGE": CONNECT_IMAGE,
        }

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        command = [str(Path(sys.executable).parent / "podman-compose"), "-p", self.project, *args]
        result = subprocess.run(
            command,
            cwd=ROOT,
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, (
            f"{' '.join(args)}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
        )
        return result

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def running(self) -> list[str]:
        listed = podman(
            "ps",
            "--all",
            "--format={{.Names}}",
            f"--filter=label=io.podman.compose.project={self.project}",
        )
        return listed.stdout.split()


@pytest.fixture
def compose(image: str) -> Iterator[Compose]:
    project = Compose(f"oncely-test-{uuid.uuid4().hex[:8]}")
    try:
        yield project
    finally:
        project("--profile", "pipeline", "--profile", "debezium", "down", "--timeout", "60")


def _healthy(container: str) -> bool:
    return podman("healthcheck", "run", container, check=False).returncode == 0


def _up(compose: Compose, profile: str, processes: Sequence[str]) -> None:
    """Bring the profile up in the order `depends_on` gives, one stage at a time: Debian's
    podman (4.3) has no `wait --condition=healthy` (podman-compose then ignores service_healthy)
    and fails to start a container whose dependencies have dependencies (hence --no-deps)."""
    compose("up", "-d", "postgres", "kafka")
    for service in ("postgres", "kafka"):  # the compose file's own health checks
        wait_for(f"{service} healthy", lambda s=service: _healthy(compose.container(s)), 120, 1)
    compose("--profile", profile, "up", "-d", "--no-deps", "migrate", "topics")
    for job in ("migrate", "topics"):
        wait_for(
            f"{job} done",
            lambda j=job: (
                podman("inspect", "--format={{.State.Status}}", compose.container(j)).stdout.strip()
                == "exited"
            ),
            120,
        )
        code = podman("inspect", "--format={{.State.ExitCode}}", compose.container(job))
        assert code.stdout.strip() == "0", podman("logs", compose.container(job)).stderr
    compose("--profile", profile, "up", "-d", "--no-deps", *processes)
    for name in processes:
        wait_for(f"{name} healthy", lambda n=name: _healthy(compose.container(n)), 120, 1)


def _events_reach_their_effects(compose: Compose) -> None:
    """Stage transfers in the compose database; wait until the ledger and the emails have them."""
    engine = sa.create_engine(compose.database_url)
    try:
        metadata.create_all(engine)
        service = TransferService(engine)
        completed = sum(
            service.request_transfer(
                idempotency_key=f"compose-{i}", from_account=f"a{i}", to_account="b", amount=10 + i
            )["status"]
            == "completed"
            for i in range(30)
        )

        expected = (2 * completed, completed)
        wait_for("the effects and the task", lambda: applied(engine) == expected, 120)
    finally:
        engine.dispose()


@pytest.mark.timeout(600)
def test_the_pipeline_profile_runs_the_payments_example_from_the_image(compose: Compose) -> None:
    _up(compose, "pipeline", PROCESSES)
    _events_reach_their_effects(compose)
    for name in PROCESSES:
        assert _healthy(compose.container(name)), name
    verify = oncely_process(
        *("verify", "--since", "1h", "--app", APP),
        env={
            "ONCELY_DATABASE_URL": compose.database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": compose.bootstrap,
        },
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    compose("--profile", "pipeline", "down", "--timeout", "60")
    assert compose.running() == []


@pytest.mark.timeout(600)
def test_the_debezium_profile_relays_with_kafka_connect_instead(compose: Compose) -> None:
    consumers = ("consumer", "send-receipt", "task-worker")
    _up(compose, "debezium", ("connect", *consumers))
    connect = compose.container("connect")
    # The compose file's own instructions: the connector configuration it mounts, POSTed.
    podman(
        "exec",
        connect,
        "curl",
        "-fsS",
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data",
        "@/oncely/debezium/oncely-outbox.json",
        "http://localhost:8083/connectors",
    )

    def running() -> bool:
        status = podman(
            "exec",
            connect,
            "curl",
            "-fsS",
            "http://localhost:8083/connectors/oncely-outbox/status",
            check=False,
        )
        if status.returncode != 0:
            return False
        states = json.loads(status.stdout)
        return states["connector"]["state"] == "RUNNING" and [
            task["state"] for task in states["tasks"]
        ] == ["RUNNING"]

    wait_for("the connector and its task running", running, 120, 1)
    _events_reach_their_effects(compose)
    for name in consumers:
        assert _healthy(compose.container(name)), name
    compose("--profile", "debezium", "down", "--timeout", "60")
    assert compose.running() == []
