"""A Kafka outage in the logs of `oncely relay run`, `oncely consume` and `oncely tasks run`: one
line when the brokers become unreachable, one with a count when they are back, and not
librdkafka's line per reconnect attempt in between (about ten a second before).

The relay and the consumer run on a broker of this module's own, stopped and started again by
each test; the task worker does not talk to Kafka at all."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.devstack._process import free_port
from oncely.devstack.kafka import KafkaNode
from tests.apps import ledger
from tests.helpers import start_oncely, wait_ready, wait_until

pytestmark = pytest.mark.acceptance

UNREACHABLE = "Kafka brokers unreachable ("
BACK = "Kafka brokers reachable again after "
#: How long each test keeps the broker down: librdkafka logged about 200 lines in 20 s.
OUTAGE = 15.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaNode]:
    """A broker of this module's own: the tests stop it."""
    node = KafkaNode(data_dir=tmp_path_factory.mktemp("outage-kafka"))
    node.start()
    try:
        yield node
    finally:
        node.stop()


class _Log:
    """A process's stderr, written to a file (read while it runs): its JSON log records (the
    command line's own warnings about the environment, plain text, are left out)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def records(self) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def messages(self, since: int = 0) -> list[str]:
        return [record["message"] for record in self.records()[since:]]


def _create_topic(bootstrap: str, topic: str) -> None:
    # A local client: one kept alive would log the outage on the test's stderr.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2)])[topic].result(30)


def _start(log: Path, *argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as stderr:
        return start_oncely(*argv, env=env, stderr=stderr)


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _outage(broker: KafkaNode, log: _Log, *, settled: str) -> tuple[list[str], list[str]]:
    """Once the process wrote ``settled`` (and a moment later), stop the broker for
    :data:`OUTAGE` seconds and start it again; what the process wrote while it was down, and
    from then until it said the brokers are back."""
    wait_until(lambda: any(settled in m for m in log.messages()), timeout=30)
    time.sleep(2)  # what the process writes on a start (e.g. a fresh broker's answers) is out
    before = len(log.records())
    broker.stop()
    time.sleep(OUTAGE)
    down = log.messages(before)
    broker.start()
    wait_until(lambda: any(BACK in m for m in log.messages(before)), timeout=40, interval=0.5)
    return down, log.messages(before + len(down))


def _check(down: list[str], after: list[str], log: _Log) -> None:
    """One line when the brokers went, few others while they were away, one when they came
    back, with what was not logged."""
    assert [m for m in down if UNREACHABLE in m] != [], down
    assert len([m for m in down if UNREACHABLE in m]) == 1, down
    assert len(down) < 5, f"{len(down)} lines in {OUTAGE:g} s of outage: {down}"
    assert not [m for m in after if UNREACHABLE in m], after
    assert len(after) < 5, after
    [back] = [r for r in log.records() if BACK in r["message"]]
    assert back["level"] == "INFO"
    assert back["not_logged"] > 20, "the reconnect attempts are counted"
    assert OUTAGE <= back["outage_seconds"] < OUTAGE + 30


def test_the_relay_writes_one_line_when_kafka_goes_and_one_when_it_is_back(
    broker: KafkaNode, database_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = _Log(tmp_path / "relay.log")
    relay = _start(
        log.path,
        *("relay", "run", "--database-url", database_url),
        *("--bootstrap-servers", broker.bootstrap_servers, "--metrics-port", str(port)),
        env={"ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2"},
    )
    try:
        wait_ready(port, relay)
        down, after = _outage(broker, log, settled="took shards")
        wait_ready(port, relay)  # ready again without a record to publish
    finally:
        code = _stop(relay)
    assert code == 0, log.messages()
    _check(down, after, log)


def test_a_consumer_writes_one_line_when_kafka_goes_and_one_when_it_is_back(
    broker: KafkaNode, database_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    app = ledger.build("outage.", group_prefix="outage.", ways=True)
    ledger.create_tables(engine)
    _create_topic(broker.bootstrap_servers, app.topic)
    port = free_port()
    log = _Log(tmp_path / "consumer.log")
    consumer = _start(
        log.path,
        *("consume", "tests.apps.ledger:effects", "--effect", "ledger"),
        *("--database-url", database_url, "--bootstrap-servers", broker.bootstrap_servers),
        env={
            **app.env,
            "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2",
            "ONCELY_CONSUMER_METRICS_PORT": str(port),
        },
    )
    try:
        wait_ready(port, consumer, timeout=60)
        down, after = _outage(broker, log, settled="partitions assigned")
    finally:
        code = _stop(consumer)
    assert code == 0, log.messages()
    _check(down, after, log)


def test_the_task_worker_writes_no_kafka_lines(database_url: str, tmp_path: Path) -> None:
    """It has no Kafka client: Kafka settings pointing at no broker change nothing."""
    log = _Log(tmp_path / "worker.log")
    worker = _start(
        log.path,
        *("tasks", "run", "tests.acceptance.task_app:tasks", "--poll-interval-seconds", "0.2"),
        env={
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        },
    )
    time.sleep(5)
    assert _stop(worker) == 0, log.messages()
    assert "task worker" in log.messages()[0], "it ran"
    assert "kafka" not in log.path.read_text().lower()
