"""Dead-letter topics are provisioned like event topics, by ``topics ensure`` and at start.

``<topic>.<effect>.dlq`` takes its source topic's declared partitions, replication factor and
``min.insync.replicas`` (with the per-event-type overrides), whether ``oncely topics ensure
--effects`` or an effect consumer starting creates it; an existing one that is weaker (such as
the one-partition topics older consumers created) is flagged. Real Kafka (a single broker).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from pydantic import BaseModel

from oncely.consumers.dlq import DeadLetterError
from oncely.consumers.effects import EffectContext, Effects
from oncely.consumers.service import build_consumers
from oncely.events import Registry
from oncely.runtime.metrics import ConsumerMetrics
from oncely.settings import ConsumerSettings, KafkaSettings, TopicSettings
from tests.apps.payments import Paid, Refunded, build
from tests.helpers import CliResult, create_topic, delete_existing, oncely_cli, wait_listed

pytestmark = pytest.mark.integration


REGISTRY, PAID, REFUNDED = build(f"dl{uuid.uuid4().hex[:8]}.")
#: Used by the CLI tests (``--effects tests.integration.test_dead_letter_topics:EFFECTS``).
EFFECTS = Effects(REGISTRY)
PAID_DLQ, REFUNDED_DLQ = f"{PAID}.notify.dlq", f"{REFUNDED}.notify.dlq"
#: An effects app over another registry: its topics are not the registry's.
OTHER = Effects(Registry(topic_prefix="elsewhere."))
OTHER.registry.register(Paid, name="order.paid", key="order", aggregate="order")


@EFFECTS.effect("notify", on=[Paid, Refunded])
def notify(event: BaseModel, ctx: EffectContext) -> None:
    pass


@OTHER.effect("notify", on=[Paid])
def other_notify(event: BaseModel, ctx: EffectContext) -> None:
    pass


ALL = [PAID, REFUNDED, PAID_DLQ, REFUNDED_DLQ]
OVERRIDES = {"ONCELY_TOPICS_OVERRIDES": json.dumps({"order.paid": {"partitions": 3}})}


@pytest.fixture
def cleanup(kafka_admin: AdminClient) -> Iterator[None]:
    yield
    delete_existing(kafka_admin, ALL)


def _cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    return oncely_cli("topics", "ensure", *args, env=env)


def _partitions(admin: AdminClient) -> dict[str, int]:
    topics = admin.list_topics(timeout=10).topics
    return {name: len(topics[name].partitions) for name in ALL if name in topics}


def _base(bootstrap: str) -> list[str]:
    return ["--registry", f"{__name__}:REGISTRY", "--bootstrap-servers", bootstrap]


def test_topics_ensure_creates_dead_letter_topics_like_their_source(
    kafka_admin: AdminClient, kafka_bootstrap: str, cleanup: None
) -> None:
    env = {**OVERRIDES, "ONCELY_TOPICS_PARTITIONS": "2"}
    result = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:EFFECTS", env=env)
    assert result.exit_code == 0, result.output
    assert f"created   {PAID_DLQ} (3 partitions, replication factor 1" in result.output
    assert f"created   {REFUNDED_DLQ} (2 partitions, replication factor 1" in result.output
    assert _partitions(kafka_admin) == {PAID: 3, REFUNDED: 2, PAID_DLQ: 3, REFUNDED_DLQ: 2}
    again = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:EFFECTS", env=env)
    assert again.exit_code == 0 and f"ok        {PAID_DLQ}" in again.output


def test_topics_ensure_flags_a_weaker_dead_letter_topic(
    kafka_admin: AdminClient, kafka_bootstrap: str, cleanup: None
) -> None:
    # As consumers created them before: one partition.
    create_topic(kafka_admin, PAID_DLQ, partitions=1)
    result = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:EFFECTS", env=OVERRIDES)
    assert result.exit_code == 1, result.output
    assert f"mismatch  {PAID_DLQ}: 1 partitions, 3 declared" in result.output
    assert f"created   {REFUNDED_DLQ} (6 partitions" in result.output
    # Declared for production, the same topic lacks replicas and min.insync.replicas too.
    strict = _cli(
        *_base(kafka_bootstrap),
        "--effects",
        f"{__name__}:EFFECTS",
        "--partitions",
        "1",
        "--replication-factor",
        "3",
        "--min-insync-replicas",
        "2",
    )
    assert strict.exit_code == 1, strict.output
    assert (
        f"mismatch  {PAID_DLQ}: replication factor 1, 3 declared; min.insync.replicas 1, 2 declared"
    ) in strict.output


def test_topics_ensure_refuses_a_wrong_effects_app_in_one_line(kafka_bootstrap: str) -> None:
    missing = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:NOPE")
    assert missing.exit_code == 2, missing.output
    assert f"has no attribute 'NOPE' (looking for '{__name__}:NOPE')" in missing.output
    registry = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:REGISTRY")
    assert registry.exit_code == 2 and "declares no effects" in registry.output
    other = _cli(*_base(kafka_bootstrap), "--effects", f"{__name__}:OTHER")
    assert other.exit_code == 2, other.output
    assert "effect 'notify' consumes topic 'elsewhere.order.paid', which no event type" in (
        other.output
    )
    assert "Traceback" not in missing.output + registry.output + other.output


def _start(bootstrap: str, database_url: str, **kwargs: Any) -> None:
    """Build the consumers as ``oncely consume`` does at start (they are not run)."""
    consumers = build_consumers(
        effects=EFFECTS,
        names=["notify"],
        engine=sa.create_engine(database_url),
        kafka=KafkaSettings(bootstrap_servers=bootstrap),
        settings=ConsumerSettings(),
        metrics=ConsumerMetrics(),
        **kwargs,
    )
    for consumer in consumers:
        consumer.dead_letters.close()


def test_a_starting_consumer_creates_dead_letter_topics_as_declared(
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    database_url: str,
    cleanup: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ONCELY_TOPICS_PARTITIONS", "5")
    monkeypatch.setenv("ONCELY_TOPICS_OVERRIDES", OVERRIDES["ONCELY_TOPICS_OVERRIDES"])
    _start(kafka_bootstrap, database_url)
    wait_listed(kafka_admin, PAID_DLQ, REFUNDED_DLQ)
    partitions = _partitions(kafka_admin)
    assert {name: partitions.get(name) for name in (PAID_DLQ, REFUNDED_DLQ)} == {
        PAID_DLQ: 3,
        REFUNDED_DLQ: 5,
    }


def test_a_starting_consumer_warns_of_a_weaker_dead_letter_topic(
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    database_url: str,
    cleanup: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    create_topic(kafka_admin, PAID_DLQ, partitions=1)
    with caplog.at_level(logging.WARNING, logger="oncely.consumers.dlq"):
        _start(kafka_bootstrap, database_url, topics=TopicSettings(partitions=4))
    wait_listed(kafka_admin, REFUNDED_DLQ)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"dead-letter topic weaker than declared: {PAID_DLQ}: 1 partitions, 4 declared"
    ]
    assert _partitions(kafka_admin) == {PAID_DLQ: 1, REFUNDED_DLQ: 4}  # never altered


def test_a_starting_consumer_that_cannot_create_a_dead_letter_topic_says_which(
    kafka_admin: AdminClient, kafka_bootstrap: str, database_url: str, cleanup: None
) -> None:
    impossible = TopicSettings(replication_factor=3, min_insync_replicas=2)  # one broker
    with pytest.raises(DeadLetterError, match=f"cannot create dead-letter topics: {PAID_DLQ}: "):
        _start(kafka_bootstrap, database_url, topics=impossible)
    assert _partitions(kafka_admin) == {}


def test_consume_reports_a_dead_letter_topic_it_cannot_create_in_one_line(
    kafka_bootstrap: str, database_url: str, cleanup: None
) -> None:
    # Were the consumer to start anyway, SIGTERM stops it (and the assertions fail).
    bound = threading.Timer(60, os.kill, args=(os.getpid(), signal.SIGTERM))
    bound.start()
    try:
        result = oncely_cli(
            "consume", f"{__name__}:EFFECTS", "--effect", "notify", "--database-url",
            database_url, "--bootstrap-servers", kafka_bootstrap, "--log-format", "text",
            env={"ONCELY_TOPICS_REPLICATION_FACTOR": "3",
                 "ONCELY_TOPICS_MIN_INSYNC_REPLICAS": "2"},
        )  # fmt: skip
    finally:
        bound.cancel()
    assert result.exit_code == 2, result.output
    assert f"error: cannot create dead-letter topics: {PAID_DLQ}: " in result.output
    assert "Traceback" not in result.output
