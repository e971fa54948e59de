"""``oncely topics ensure`` against the real broker: creation, weaker topics, impossible layouts.

The suite's broker is a single node, which is enough to prove the mismatch report: a topic
that exists with replication factor 1 while 3 is declared is flagged, and a topic that cannot
be created with 3 replicas is reported as failed (not a traceback).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from oncely.settings import TopicSettings
from oncely.topics import TopicSpec, ensure_topics, planned_topics
from tests.apps.payments import build
from tests.helpers import (
    CliResult,
    create_topic,
    delete_existing,
    delete_topics,
    oncely_cli,
    wait_listed,
)

pytestmark = pytest.mark.integration


#: Used by the CLI test (``--registry tests.integration.test_topics_ensure:REGISTRY``).
REGISTRY, PAID, REFUNDED = build(f"te{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def cleanup(kafka_admin: AdminClient) -> Iterator[None]:
    yield
    delete_existing(kafka_admin, [PAID, REFUNDED])


def _cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    return oncely_cli("topics", "ensure", *args, env=env)


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
    as_json = _cli(*base, "--json")
    assert as_json.exit_code == 1, as_json.output
    document = json.loads(as_json.stdout)
    assert document["created"] == [] and document["matching"] == [REFUNDED]
    assert document["failed"] == [] and document["mismatches"][0].startswith(
        f"{PAID}: 2 partitions, 6 declared"
    )
    # Declared for production: the existing topic is weaker, nothing is created on one broker.
    delete_topics(kafka_admin, [REFUNDED])
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
    wait_listed(kafka_admin, PAID, REFUNDED)
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


class ChangingAdmin(AdminClient):
    """A real admin client with another job at work: right after each of its first
    ``listings`` listings, that job deletes ``deletes`` (re-creating it first each time when
    ``recreate``) or creates ``creates``, and the change is visible before the listing returns.
    So ``ensure_topics`` plans from a listing that is already out of date."""

    def __init__(
        self,
        bootstrap: str,
        *,
        deletes: str | None = None,
        creates: str | None = None,
        recreate: bool = False,
        listings: int = 1,
    ) -> None:
        super().__init__({"bootstrap.servers": bootstrap})
        self.other = AdminClient({"bootstrap.servers": bootstrap})
        self.deletes, self.creates, self.recreate, self.left = deletes, creates, recreate, listings

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        if self.left and self.recreate and self.deletes:
            create_topic(self.other, self.deletes, partitions=6)
        metadata = super().list_topics(*args, **kwargs)
        if self.left:
            self.left -= 1
            if self.deletes:
                delete_topics(self.other, [self.deletes])
            if self.creates:
                create_topic(self.other, self.creates, partitions=2)
        return metadata


def _paid_spec() -> list[TopicSpec]:
    return [spec for spec in planned_topics(REGISTRY, TopicSettings()) if spec.name == PAID]


def test_a_topic_deleted_between_listing_and_describing_is_planned_again(
    kafka_admin: AdminClient, kafka_bootstrap: str, cleanup: None
) -> None:
    create_topic(kafka_admin, PAID, partitions=6)
    admin = ChangingAdmin(kafka_bootstrap, deletes=PAID)
    report = ensure_topics(admin, _paid_spec())
    # Listed, deleted, not found when described: the next round finds it missing, creates it.
    assert (report.created, report.matching, report.mismatches, report.failed) == (
        [PAID],
        [],
        [],
        [],
    )
    assert len(kafka_admin.list_topics(timeout=10).topics[PAID].partitions) == 6


def test_a_topic_that_keeps_changing_is_reported_in_one_line(
    kafka_bootstrap: str, cleanup: None
) -> None:
    admin = ChangingAdmin(kafka_bootstrap, deletes=PAID, recreate=True, listings=2)
    report = ensure_topics(admin, _paid_spec(), attempts=2)
    assert report.failed == [
        f"{PAID}: deleted by someone else while being checked (2 attempts); run again"
    ]
    assert (report.created, report.matching, report.mismatches) == ([], [], [])


def test_a_topic_created_between_listing_and_creating_is_checked(
    kafka_bootstrap: str, cleanup: None
) -> None:
    admin = ChangingAdmin(kafka_bootstrap, creates=PAID)
    report = ensure_topics(admin, _paid_spec())
    assert (report.created, report.matching, report.failed) == ([], [], [])
    assert report.mismatches == [f"{PAID}: 2 partitions, 6 declared"]
