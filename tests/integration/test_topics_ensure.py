"""``oncely topics ensure`` against the real broker: creation, weaker topics, impossible layouts.

The suite's broker is a single node, which is enough to prove the mismatch report: a topic
that exists with replication factor 1 while 3 is declared is flagged, and a topic that cannot
be created with 3 replicas is reported as failed (not a traceback).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import typer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
from pydantic import BaseModel
from typer.testing import CliRunner, Result

from oncely.cli.topics import ensure
from oncely.events import Registry
from oncely.relay.topics import ensure_topics, planned_topics
from oncely.settings import TopicSettings

pytestmark = pytest.mark.integration


class Paid(BaseModel):
    order: str


class Refunded(BaseModel):
    order: str


#: Used by the CLI test (``--registry tests.integration.test_topics_ensure:REGISTRY``).
REGISTRY = Registry(topic_prefix=f"te{uuid.uuid4().hex[:8]}.")
REGISTRY.register(Paid, name="order.paid", key="order", aggregate="order")
REGISTRY.register(Refunded, name="order.refunded", key="order", aggregate="order")
PAID, REFUNDED = (REGISTRY.get(name).topic for name in ("order.paid", "order.refunded"))


@pytest.fixture
def cleanup(kafka_admin: AdminClient) -> Iterator[None]:
    yield
    existing = set(kafka_admin.list_topics(timeout=10).topics)
    doomed = [topic for topic in (PAID, REFUNDED) if topic in existing]
    if doomed:
        for future in kafka_admin.delete_topics(doomed).values():
            future.result(30)


def _cli(*args: str, env: dict[str, str] | None = None) -> Result:
    command = typer.Typer()
    command.command()(ensure)
    return CliRunner().invoke(command, list(args), env=env)


def test_a_topic_with_fewer_replicas_than_declared_is_a_mismatch(
    kafka_admin: AdminClient, cleanup: None
) -> None:
    kafka_admin.create_topics([NewTopic(PAID, num_partitions=6, replication_factor=1)])[
        PAID
    ].result(30)
    settings = TopicSettings(replication_factor=3, min_insync_replicas=2)
    report = ensure_topics(
        kafka_admin, [s for s in planned_topics(REGISTRY, settings) if s.name == PAID]
    )
    assert report.created == [] and report.matching == [] and report.failed == []
    [problem] = report.mismatches
    assert problem.startswith(f"{PAID}: ")
    assert "replication factor 1, 3 declared" in problem
    assert "min.insync.replicas 1, 2 declared" in problem
    assert "partitions" not in problem


def test_cli_flags_weaker_topics_and_reports_what_it_cannot_create(
    kafka_admin: AdminClient, kafka_bootstrap: str, cleanup: None
) -> None:
    kafka_admin.create_topics([NewTopic(PAID, num_partitions=2, replication_factor=1)])[
        PAID
    ].result(30)
    base = ["--registry", f"{__name__}:REGISTRY", "--bootstrap-servers", kafka_bootstrap]
    # As declared by default (1 replica), order.paid only lacks partitions.
    result = _cli(*base)
    assert result.exit_code == 1, result.output
    assert f"created   {REFUNDED} (6 partitions, replication factor 1" in result.output
    assert f"mismatch  {PAID}: 2 partitions, 6 declared" in result.output
    # Declared for production: the existing topic is weaker, nothing is created on one broker.
    kafka_admin.delete_topics([REFUNDED])[REFUNDED].result(30)
    result = _cli(
        *base, "--partitions", "2", "--replication-factor", "3", "--min-insync-replicas", "2"
    )
    assert result.exit_code == 1, result.output
    assert f"mismatch  {PAID}: replication factor 1, 3 declared" in result.output
    assert f"failed    {REFUNDED}: " in result.output
    assert "Traceback" not in result.output


def test_overrides_set_one_event_type_apart(
    kafka_admin: AdminClient, kafka_bootstrap: str, cleanup: None
) -> None:
    overrides = {"order.refunded": {"partitions": 3, "min_insync_replicas": 1}}
    env = {"ONCELY_TOPICS_OVERRIDES": json.dumps(overrides), "ONCELY_TOPICS_PARTITIONS": "2"}
    base = ["--registry", f"{__name__}:REGISTRY", "--bootstrap-servers", kafka_bootstrap]
    result = _cli(*base, env=env)
    assert result.exit_code == 0, result.output
    partitions = {
        name: len(topic.partitions)
        for name, topic in kafka_admin.list_topics(timeout=10).topics.items()
        if name in (PAID, REFUNDED)
    }
    assert partitions == {PAID: 2, REFUNDED: 3}
    [future] = kafka_admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, REFUNDED)]
    ).values()
    assert future.result(30)["min.insync.replicas"].value == "1"
    again = _cli(*base, env=env)
    assert again.exit_code == 0 and f"ok        {REFUNDED}" in again.output
    typo = _cli(*base, env={"ONCELY_TOPICS_OVERRIDES": '{"order.refundd": {"partitions": 1}}'})
    assert typo.exit_code == 2 and "unknown event types: order.refundd" in typo.output
    impossible = _cli(*base, "--replication-factor", "1", "--min-insync-replicas", "2")
    assert impossible.exit_code == 2 and "exceeds replication_factor 1" in impossible.output
