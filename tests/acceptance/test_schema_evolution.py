"""`oncely consume` across a schema change: records of another version are applied, not lost.

Each test runs `oncely consume` in a subprocess, with the committed catalog written by the
export code into a folder of its own, against real Kafka and PostgreSQL. ``order.placed`` v2
adds a field with a default to v1 (see ``tests/apps/orders.py``).
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import NewTopic

from oncely.events import Encoding
from oncely.schemas.catalog import export_schemas
from oncely.schemas.codec import Codec
from tests.apps.orders import Version, build, create_tables
from tests.helpers import (
    oncely_process,
    publish_events,
    read_topics,
    scalar,
    start_oncely,
    wait_until,
)

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
EFFECT = "orders"


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url, pool_size=2)
    create_tables(engine)
    yield engine
    engine.dispose()


def catalog(directory: Path, *committed: Version) -> Path:
    """The catalog folder as `oncely schemas export` leaves it after each version's export."""
    for version in committed:
        export_schemas(version.registry, directory)
    return directory


class ConsumeProcess:
    """`oncely consume tests.apps.orders:effects_v<N> --effect orders` in a subprocess."""

    def __init__(
        self,
        version: int,
        prefix: str,
        database_url: str,
        bootstrap: str,
        *args: str,
        cwd: Path,
        encoding: Encoding = "avro",
        env: dict[str, str] | None = None,
    ) -> None:
        self.process = start_oncely(
            *("consume", f"tests.apps.orders:effects_v{version}", "--effect", EFFECT),
            *("--database-url", database_url, "--bootstrap-servers", bootstrap, *args),
            cwd=cwd,
            env={
                "PYTHONPATH": str(REPO),
                "ONCELY_TEST_TOPIC_PREFIX": prefix,
                "ONCELY_TEST_GROUP_PREFIX": prefix,
                "ONCELY_TEST_ENCODING": encoding,
                "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2",
                **(env or {}),
            },
            without=["ONCELY_SCHEMAS_DIR"],
        )
        self.log: list[dict[str, Any]] = []

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM, wait, check the exit; return its log records (JSON lines)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        _, text = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, text
        self.log = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        return self.log


def dlq_depth(bootstrap: str, topic: str) -> int:
    """Records in every partition of ``topic`` (0 while it does not exist yet)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"depth-{uuid.uuid4().hex}"})
    try:
        listed = consumer.list_topics(topic, timeout=5).topics.get(topic)
        if listed is None or listed.error is not None:
            return 0
        depth = 0
        for partition in listed.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
            depth += high - low
    except KafkaException:
        return 0
    finally:
        consumer.close()
    return int(depth)


def settle(
    engine: sa.Engine, bootstrap: str, version: Version, count: int, process: ConsumeProcess
) -> tuple[int, int]:
    """Wait until ``count`` records are applied or dead-lettered; (applied, dead-lettered)."""
    dlq = version.effects.get(EFFECT).dlq_topic(version.topic)
    outcome = (0, 0)

    def done() -> bool:
        nonlocal outcome
        assert process.alive(), "the consumer exited"
        applied = scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = :e", e=EFFECT)
        assert isinstance(applied, int)
        outcome = (applied, dlq_depth(bootstrap, dlq))
        return sum(outcome) >= count

    wait_until(done, timeout=90, interval=0.5)
    return outcome


def rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        result = conn.execute(
            sa.text(
                "SELECT order_id, amount, currency, code_version FROM orders_applied"
                " ORDER BY amount"
            )
        )
        return [tuple(row) for row in result]


def events(version: Version, count: int, start: int = 0, **fields: Any) -> list[tuple[Any, Any]]:
    return [
        (uuid.uuid4(), version.model(order_id=f"o-{i % 7}", amount=i, **fields))
        for i in range(start, start + count)
    ]


def dead_letter_warnings(log: Sequence[dict[str, Any]]) -> list[str]:
    return [
        str(r["message"])
        for r in log
        if r.get("level") == "WARNING" and str(r["message"]).startswith("dead-lettered")
    ]


@dataclass
class Orders:
    """v1 and v2 of the orders app on a topic of their own, the database, and `oncely consume`
    with either version's code against them, run in ``cwd``."""

    v1: Version
    v2: Version
    prefix: str
    engine: sa.Engine
    database_url: str
    bootstrap: str
    cwd: Path
    encoding: Encoding

    def publish(self, version: Version, sent: Sequence[tuple[Any, Any]]) -> None:
        publish_events(self.bootstrap, Codec(registry=version.registry), sent)

    def consume(
        self, version: Version, count: int, *args: str, env: dict[str, str] | None = None
    ) -> tuple[int, int, list[dict[str, Any]]]:
        """Run `oncely consume` with ``version``'s code until ``count`` records are applied or
        dead-lettered, then stop it: (applied, dead-lettered, its log records)."""
        number = version.registry.get("order.placed").version
        process = ConsumeProcess(
            number, self.prefix, self.database_url, self.bootstrap, *args,
            cwd=self.cwd, encoding=self.encoding, env=env,
        )  # fmt: skip
        try:
            applied, dead = settle(self.engine, self.bootstrap, version, count, process)
        finally:
            log = process.stop()
        return applied, dead, log


@pytest.fixture
def encoding() -> Encoding:
    """The orders app's encoding; a test parametrizes it to run with others."""
    return "avro"


@pytest.fixture
def orders(
    encoding: Encoding,
    kafka_admin: Any,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> Orders:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    v1, v2 = build(prefix, group_prefix=prefix, encoding=encoding)
    kafka_admin.create_topics([NewTopic(v1.topic, num_partitions=1)])[v1.topic].result(30)
    return Orders(v1, v2, prefix, engine, database_url, kafka_bootstrap, tmp_path, encoding)


@pytest.mark.parametrize("encoding", ["avro", "json"])
def test_a_consumer_deployed_first_applies_v1_records_with_v2_code_new_fields_defaulted(
    orders: Orders,
) -> None:
    v1, v2 = orders.v1, orders.v2
    schemas = catalog(orders.cwd / "catalog", v1, v2)
    orders.publish(v1, events(v1, 40))
    applied, dead, log = orders.consume(v2, 40, "--schemas-dir", str(schemas))
    assert (applied, dead) == (40, 0), "every v1 record applied by the v2 code, none dead"
    assert rows(orders.engine) == [(f"o-{i % 7}", i, "EUR", 2) for i in range(40)], "default taken"
    assert dead_letter_warnings(log) == []


def test_a_producer_deployed_first_has_v2_records_applied_by_v1_code(orders: Orders) -> None:
    v1, v2 = orders.v1, orders.v2
    schemas = catalog(orders.cwd / "catalog", v1, v2)  # the v2 schema is committed with the change
    orders.publish(v2, events(v2, 40, currency="USD"))
    applied, dead, log = orders.consume(v1, 40, env={"ONCELY_SCHEMAS_DIR": str(schemas)})
    assert (applied, dead) == (40, 0), "every v2 record applied by the v1 code, none dead"
    assert rows(orders.engine) == [(f"o-{i % 7}", i, None, 1) for i in range(40)], (
        "new field dropped"
    )
    assert dead_letter_warnings(log) == []


def test_a_replay_to_earliest_after_the_upgrade_applies_the_old_records(orders: Orders) -> None:
    v1, v2 = orders.v1, orders.v2
    schemas = catalog(orders.cwd / "schemas", v1)  # ./schemas of the service's checkout
    orders.publish(v1, events(v1, 20))
    assert orders.consume(v1, 20)[:2] == (20, 0)

    # The upgrade: v2 is exported next to v1, producers and consumers run the v2 code.
    catalog(schemas, v2)
    orders.publish(v2, events(v2, 20, start=20))
    assert orders.consume(v2, 40)[:2] == (40, 0)

    # Rebuild the projection from the topic: forget it and its receipts, replay to earliest.
    with orders.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM orders_applied"))
        conn.execute(sa.text("DELETE FROM oncely_receipts WHERE effect = :e"), {"e": EFFECT})
    replay = oncely_process(
        *("replay", "--app", "tests.apps.orders:effects_v2", "--effect", EFFECT),
        *("--to-earliest", "--execute", "--bootstrap-servers", orders.bootstrap),
        cwd=orders.cwd,
        env={
            "PYTHONPATH": str(REPO),
            "ONCELY_TEST_TOPIC_PREFIX": orders.prefix,
            "ONCELY_TEST_GROUP_PREFIX": orders.prefix,
        },
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    assert "40 record(s) will be re-read" in replay.stdout

    applied, dead, log = orders.consume(v2, 40)
    assert (applied, dead) == (40, 0), "the v1 history applied again, none dead-lettered"
    assert rows(orders.engine) == [
        *[(f"o-{i % 7}", i, "EUR", 2) for i in range(20)],
        *[(f"o-{i % 7}", i, "EUR", 2) for i in range(20, 40)],
    ]
    assert dead_letter_warnings(log) == []
    assert any(str(r["message"]).startswith(f"schema catalog {schemas}") for r in log), (
        "./schemas was loaded by default"
    )


def test_an_unknown_writer_schema_is_dead_lettered_with_the_reason_and_a_warning(
    orders: Orders,
) -> None:
    v1, v2 = orders.v1, orders.v2
    schemas = catalog(orders.cwd / "catalog", v1)  # v2 was never exported to this catalog
    sent = events(v2, 5, currency="USD")
    orders.publish(v2, sent)
    applied, dead, log = orders.consume(v1, 5, "--schemas-dir", str(schemas))
    assert (applied, dead) == (0, 5)
    fingerprint = v2.registry.get("order.placed").fingerprint.hex()
    dlq = read_topics(orders.bootstrap, [v1.effects.get(EFFECT).dlq_topic(v1.topic)])
    # the DLQ has its source topic's partitions: order holds per key, not across the topic
    assert sorted(r.headers["id"].decode() for r in dlq) == sorted(str(i) for i, _ in sent)
    for record in dlq:
        assert record.headers["oncely.dlq.reason"] == b"undecodable"
        reason = record.headers["oncely.dlq.error.message"].decode()
        assert "unknown-schema" in reason
        assert "'order.placed'" in reason, "names the event type"
        assert fingerprint in reason, "names the fingerprint"
        assert str(schemas.absolute()) in reason, "names the catalog folder searched"
    warnings = dead_letter_warnings(log)
    assert len(warnings) == 5, "one WARNING line per dead-lettered record"
    for line in warnings:
        assert fingerprint in line and str(schemas.absolute()) in line
        assert "oncely schemas export" in line, "says how to fix it"
        assert "oncely replay" in line and "--to-offset" in line
