"""A failure costs only the rows it concerns, against real Kafka and PostgreSQL.

A topic that does not exist (or that the relay may not describe) holds its own rows, parked by
key, and is published by itself once it exists; a record the broker refuses replays only the
shard that holds it. Every other shard and topic keeps flowing with no replay: the tests count
replays and producer recreations, never time.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)
from pydantic import SecretStr

from oncely.ops.status import collect_status
from oncely.relay import Relay
from oncely.relay.signals import Signal
from oncely.settings import KafkaSettings
from oncely.storage.tables import DEFAULT_SHARDS, shard_of
from tests.helpers import (
    fast_settings,
    insert_rows,
    outbox_rows,
    query_all,
    read_committed,
    read_topics,
    running_relay,
    signals_of,
    wait_until,
)
from tests.integration.secure_kafka import USER, SecureKafka, start_secure_kafka

pytestmark = pytest.mark.integration


def _samples(relay: Relay, name: str, label: str) -> dict[str, float]:
    return {
        s.labels[label]: s.value
        for m in relay.metrics.registry.collect()
        for s in m.samples
        if s.name == name
    }


def _replays(relay: Relay) -> dict[str, float]:
    return _samples(relay, "oncely_relay_shard_replays_total", "shard")


def _recreations(relay: Relay) -> float:
    return sum(_samples(relay, "oncely_relay_producer_recreations_total", "reason").values())


def _blocked_rows(relay: Relay) -> dict[str, float]:
    return _samples(relay, "oncely_relay_blocked_rows", "topic")


def _parked(engine: sa.Engine) -> list[tuple[str, str, str]]:
    rows = query_all(engine, "SELECT topic, aggregateid, reason FROM oncely_relay_parked")
    return sorted((r.topic, r.aggregateid, r.reason) for r in rows)


def _ids(records: list, topic: str) -> list[str]:  # type: ignore[type-arg]
    return [r.headers["id"].decode() for r in records if r.topic == topic]


def _in_key_order(records: list, rows: list[dict[str, object]]) -> None:  # type: ignore[type-arg]
    """Per key, the first copies of the records are the rows in the order they were staged."""
    staged: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        staged[str(row["aggregateid"])].append(str(row["id"]))
    seen: dict[str, list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        seen[record.key].append(record.headers["id"].decode())
    assert {key: list(dict.fromkeys(ids)) for key, ids in seen.items()} == dict(staged)


def _create(admin: AdminClient, topic: str, partitions: int = 2) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[
        topic
    ].result(30)


@pytest.fixture
def missing_topic(kafka_admin: AdminClient) -> Iterator[str]:
    """A topic name nobody created yet (deleted after the test if the test created it)."""
    name = f"test-missing-{uuid.uuid4().hex}"
    yield name
    if name in kafka_admin.list_topics(timeout=10).topics:
        kafka_admin.delete_topics([name])[name].result(30)


def test_a_missing_topic_holds_only_its_rows_and_resumes_once_created(
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    new_topic: Callable[..., str],
    missing_topic: str,
    caplog: pytest.LogCaptureFixture,
    relay_mode: dict[str, object],
) -> None:
    flowing = new_topic(partitions=2)
    held = outbox_rows(60, topics=[missing_topic], keys=6)
    other = outbox_rows(300, topics=[flowing], keys=40)
    missing_shards = {shard_of(missing_topic, f"key-{k}", DEFAULT_SHARDS) for k in range(6)}
    insert_rows(engine, held[:30] + other[:150])
    caplog.set_level(logging.WARNING, logger="oncely.relay")
    with running_relay(engine, kafka_bootstrap, fast_settings(**relay_mode)) as relay:
        wait_until(lambda: _blocked_rows(relay).get(missing_topic) == 30, timeout=60)
        insert_rows(engine, held[30:] + other[150:])
        wait_until(lambda: len(read_committed(kafka_bootstrap, [flowing])) >= 300, timeout=60)
        wait_until(lambda: _blocked_rows(relay).get(missing_topic) == 60, timeout=60)
        assert {t for t, _, reason in _parked(engine) if reason == "blocked"} == {missing_topic}
        assert len(_parked(engine)) == 6, "one parked row per key, the later ones held"
        assert not any(_replays(relay).get(str(s)) for s in range(DEFAULT_SHARDS)), (
            "no shard replays: the missing topic's rows are parked, never produced"
        )
        assert _recreations(relay) == 0
        report = collect_status(engine, effects=None, kafka_config=None)
        [topic] = [t for t in report.topics if t.topic == missing_topic]
        assert (topic.blocked_rows, topic.blocked_error) == (
            60,
            f"topic {missing_topic} is missing",
        )
        assert any(
            note.startswith(
                f"topic {missing_topic} is missing since {topic.blocked_since}: 60 rows"
            )
            for note in report.notes
        ), report.notes

        signals = signals_of(relay)
        _create(kafka_admin, missing_topic)
        wait_until(lambda: len(signals.events(Signal.RELEASED)) == 6, timeout=60)  # each key
        assert _parked(engine) == []
        wait_until(lambda: missing_topic not in _blocked_rows(relay), timeout=30)
        assert _recreations(relay) == 0
        replayed = {int(s) for s, n in _replays(relay).items() if n}
        assert replayed <= missing_shards, "only shards holding the missing topic's rows"
    records = read_committed(kafka_bootstrap, [flowing, missing_topic])
    assert sorted(_ids(records, flowing)) == sorted(str(r["id"]) for r in other), (
        "every row of the other topic once: no duplicate"
    )
    assert set(_ids(records, missing_topic)) == {str(r["id"]) for r in held}, "nothing lost"
    _in_key_order([r for r in records if r.topic == missing_topic], held)
    blocked_lines = [r for r in caplog.records if "is missing" in r.getMessage()]
    back_lines = [r for r in caplog.records if "exists now" in r.getMessage()]
    assert len(blocked_lines) == 1 and blocked_lines[0].levelno == logging.WARNING
    assert len(back_lines) == 1 and back_lines[0].levelno == logging.WARNING


def test_a_record_refused_for_size_replays_only_its_own_shard(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    small = new_topic(partitions=1, config={"max.message.bytes": "10000"})
    flowing = new_topic(partitions=2)
    refused = outbox_rows(3, topics=[small], keys=1)  # key-0: the first too large, two behind
    refused[0]["payload"] = os.urandom(50_000)
    own = shard_of(small, "key-0", DEFAULT_SHARDS)
    other = [
        row
        for row in outbox_rows(400, topics=[flowing], keys=80)
        if shard_of(flowing, str(row["aggregateid"]), DEFAULT_SHARDS) != own
    ]
    insert_rows(engine, refused[:1] + other[: len(other) // 2] + refused[1:])
    insert_rows(engine, other[len(other) // 2 :])
    settings = fast_settings(
        max_attempts=2, backoff_base_seconds=0.2, backoff_max_seconds=0.5, **relay_mode
    )
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: [r for _, _, r in _parked(engine)] == ["dead"], timeout=60)
        wait_until(
            lambda: len(read_committed(kafka_bootstrap, [flowing])) >= len(other), timeout=60
        )
        replays = _replays(relay)
        assert {int(s) for s, n in replays.items() if n} <= {own}, "only the refused row's shard"
        assert _recreations(relay) == 0
    records = read_committed(kafka_bootstrap, [flowing, small])
    assert sorted(_ids(records, flowing)) == sorted(str(r["id"]) for r in other), "no duplicate"
    assert _ids(records, small) == [], "the refused key waits behind its dead row"


def test_a_topic_deleted_while_the_relay_runs_is_held_and_resumes(
    engine: sa.Engine,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    new_topic: Callable[..., str],
    missing_topic: str,
) -> None:
    flowing = new_topic(partitions=2)
    _create(kafka_admin, missing_topic)
    first = outbox_rows(40, topics=[missing_topic], keys=4)
    insert_rows(engine, first)
    settings = fast_settings(delivery_timeout_ms=3000)
    with running_relay(engine, kafka_bootstrap, settings) as relay:
        wait_until(lambda: len(read_topics(kafka_bootstrap, [missing_topic])) == 40, timeout=60)
        kafka_admin.delete_topics([missing_topic])[missing_topic].result(30)
        wait_until(
            lambda: missing_topic not in kafka_admin.list_topics(timeout=10).topics, timeout=30
        )
        later = outbox_rows(40, topics=[missing_topic], keys=4)
        other = outbox_rows(100, topics=[flowing], keys=20)
        insert_rows(engine, later + other)
        wait_until(lambda: _blocked_rows(relay).get(missing_topic) == 40, timeout=90)
        wait_until(lambda: len(read_topics(kafka_bootstrap, [flowing])) >= 100, timeout=60)
        assert _recreations(relay) == 0
        _create(kafka_admin, missing_topic)
        wait_until(lambda: _parked(engine) == [], timeout=60)
        replays = _replays(relay)
    records = read_topics(kafka_bootstrap, [flowing, missing_topic])
    # Its records in flight hang until the delivery timeout: the shards holding them replay
    # (duplicates there, in order), no other shard does.
    deleted_shards = {shard_of(missing_topic, f"key-{k}", DEFAULT_SHARDS) for k in range(4)}
    assert {int(s) for s, n in replays.items() if n} <= deleted_shards
    copies = Counter(_ids(records, flowing))
    assert set(copies) == {str(r["id"]) for r in other}, "nothing lost"
    assert all(
        shard_of(flowing, str(r["aggregateid"]), DEFAULT_SHARDS) in deleted_shards
        for r in other
        if copies[str(r["id"])] > 1
    ), "a duplicate only from a shard holding the deleted topic's rows"
    assert set(_ids(records, missing_topic)) == {str(r["id"]) for r in later}, "nothing lost"
    _in_key_order([r for r in records if r.topic == missing_topic], later)


@pytest.fixture(scope="module")
def acl_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    kafka = start_secure_kafka(tmp_path_factory.mktemp("acl-kafka"), authorizer=True)
    yield kafka
    kafka.node.stop()


def _deny(topic: str) -> AclBinding:
    return AclBinding(
        ResourceType.TOPIC,
        topic,
        ResourcePatternType.LITERAL,
        f"User:{USER}",
        "*",
        AclOperation.ALL,
        AclPermissionType.DENY,
    )


@pytest.mark.timeout(300)
def test_a_topic_the_acl_denies_is_held_like_a_missing_one(
    engine: sa.Engine, acl_kafka: SecureKafka, tmp_path: Path
) -> None:
    admin = AdminClient({"bootstrap.servers": acl_kafka.plaintext})
    denied, flowing = f"test-denied-{uuid.uuid4().hex}", f"test-allowed-{uuid.uuid4().hex}"
    for topic in (denied, flowing):
        _create(admin, topic)
    for future in admin.create_acls([_deny(denied)]).values():
        future.result(30)
    kafka = KafkaSettings(
        bootstrap_servers=acl_kafka.sasl,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=SecretStr(acl_kafka.password),
    )
    held = outbox_rows(30, topics=[denied], keys=3)
    other = outbox_rows(60, topics=[flowing], keys=10)
    insert_rows(engine, held + other)
    with running_relay(engine, acl_kafka.sasl, fast_settings(), kafka=kafka) as relay:
        wait_until(lambda: _blocked_rows(relay).get(denied) == 30, timeout=60)
        wait_until(lambda: len(read_topics(acl_kafka.plaintext, [flowing])) >= 60, timeout=60)
        assert {(t, r) for t, _, r in _parked(engine)} == {(denied, "blocked")}
        with engine.connect() as conn:
            errors = set(conn.execute(sa.text("SELECT error FROM oncely_relay_parked")).scalars())
        assert errors == {f"topic {denied} is not authorised"}
        assert _recreations(relay) == 0
        assert not any(_replays(relay).values())
        acl = AclBindingFilter(
            ResourceType.TOPIC,
            denied,
            ResourcePatternType.LITERAL,
            None,
            None,
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
        for future in admin.delete_acls([acl]).values():
            future.result(30)
        wait_until(lambda: _parked(engine) == [], timeout=90)
    records = read_topics(acl_kafka.plaintext, [flowing, denied])
    assert sorted(_ids(records, flowing)) == sorted(str(r["id"]) for r in other)
    assert set(_ids(records, denied)) == {str(r["id"]) for r in held}
    _in_key_order([r for r in records if r.topic == denied], held)
