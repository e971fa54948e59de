"""The image runs the payments example as containers against real Kafka and PostgreSQL: the
tables, the topics, a relay (then two), one consumer and the task worker, each read-only as the
image's non-root user; SIGTERM drains and exits 0 within the grace period, nothing is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
import sqlalchemy as sa
from examples.payments.models import metadata, transfers
from examples.payments.service import LIMIT, TransferService
from prometheus_client.parser import text_string_to_metric_families

from oncely.devstack._process import free_ports
from tests.container.payments import applied
from tests.container.podman import Containers, containers, http_get, podman, wait_for

APP = "examples.payments.app:app"
#: The relay drains for up to 30 s (ONCELY_RELAY_SHUTDOWN_TIMEOUT_SECONDS); compose gives it 45.
GRACE = 45


@pytest.fixture
def group(database_url: str, kafka_bootstrap: str, image: str) -> Iterator[Containers]:
    yield from containers(
        {"ONCELY_DATABASE_URL": database_url, "ONCELY_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    )


def _metric(port: int, name: str) -> float:
    """The sum of a metric's samples (0 while the port does not answer yet)."""
    _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _transfers(service: TransferService, count: int, batch: str) -> int:
    """Request ``count`` transfers (one in five over the limit); return how many completed."""
    completed = 0
    for i in range(count):
        amount = LIMIT + 1 if i % 5 == 4 else Decimal("10.00") + i
        result = service.request_transfer(
            idempotency_key=f"{batch}-{i}",
            from_account=f"a{i % 7}",
            to_account=f"b{i % 3}",
            amount=amount,
        )
        completed += result["status"] == "completed"
    return completed


def _stop(group: Containers, name: str) -> float:
    """SIGTERM ``name`` (podman stop, SIGKILL after GRACE); assert it exited 0 by itself."""
    start = time.monotonic()
    group_stop = podman("stop", f"--time={GRACE}", name, timeout=GRACE + 30)
    took = time.monotonic() - start
    assert group_stop.returncode == 0
    state = group.inspect(name)["State"]
    assert state["ExitCode"] == 0, group.logs(name)[-3000:]
    assert took < GRACE, f"{name} needed SIGKILL ({took:.1f} s)"
    return took


def test_the_image_runs_the_payments_pipeline_read_only_as_its_user_and_drains_on_sigterm(
    group: Containers, engine: sa.Engine
) -> None:
    # The one-shot jobs: the tables are already there (the fixture's template), so db upgrade
    # has nothing to do but must still run; topics ensure creates the topics and DLQs.
    upgrade = group.run("migrate", "db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    topics = group.run("topics", "topics", "ensure", "--app", APP)
    assert topics.returncode == 0, topics.stderr
    metadata.create_all(engine)

    relay_port, relay2_port, consumer_port, tasks_port = free_ports(4)
    start = time.monotonic()
    relay = group.start("relay", "relay", "run", "--metrics-port", str(relay_port))
    cold_start = wait_for(
        "the relay's /readyz", lambda: http_get(f"http://127.0.0.1:{relay_port}/readyz")[0] == 200
    )
    print(f"relay container: podman run to /readyz in {time.monotonic() - start:.2f} s")
    consumer = group.start(
        "consumer",
        "consume",
        "--app",
        APP,
        "--effect",
        "ledger-projection",
        "--effect",
        "send-receipt",
        "--metrics-port",
        str(consumer_port),
    )
    worker = group.start("tasks", "tasks", "run", "--app", APP, "--metrics-port", str(tasks_port))
    for port in (consumer_port, tasks_port):
        wait_for(
            f"/readyz on {port}", lambda p=port: http_get(f"http://127.0.0.1:{p}/readyz")[0] == 200
        )
    assert cold_start < 30

    for name, port in ((relay, relay_port), (consumer, consumer_port), (worker, tasks_port)):
        for path in ("/healthz", "/readyz", "/metrics"):
            assert http_get(f"http://127.0.0.1:{port}{path}")[0] == 200, (name, path)
        # The image's HEALTHCHECK finds each process's port by itself.
        assert podman("healthcheck", "run", name, check=False).returncode == 0, name
        inspected = group.inspect(name)
        assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"

    service = TransferService(engine)
    completed = _transfers(service, 40, "first")

    wait_for("the effects and the tasks", lambda: applied(engine) == (2 * completed, completed), 90)

    # A second relay shares the shards with the first.
    relay2 = group.start("relay2", "relay", "run", "--metrics-port", str(relay2_port))
    wait_for(
        "both relays holding shards",
        lambda: (
            _metric(relay_port, "oncely_relay_shards") > 0
            and _metric(relay2_port, "oncely_relay_shards") > 0
        ),
        60,
    )

    # SIGTERM under load: both relays drain and exit 0; a fresh relay publishes the rest.
    completed += _transfers(service, 200, "second")
    for name in (relay, relay2):
        _stop(group, name)
    group.start("relay3", "relay", "run")
    wait_for("the second batch applied", lambda: applied(engine) == (2 * completed, completed), 120)
    for name in (consumer, worker, f"{group.prefix}-relay3"):
        _stop(group, name)

    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(transfers)) == 240
    verify = group.run("verify", "verify", "--since", "1h", "--app", APP)
    assert verify.returncode == 0, verify.stdout + verify.stderr
