"""The declared layout of topics (per event type overrides) and a cluster node's properties."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ValidationError

from oncely.consumers.effects import Effects
from oncely.devstack.cluster import KafkaCluster
from oncely.devstack.kafka import KafkaNodeConfig
from oncely.errors import ConfigurationError, DevstackError
from oncely.events import Registry
from oncely.settings import TopicLayout, TopicSettings
from oncely.topics import TopicSpec, dead_letter_topics, differences, planned_topics


class Opened(BaseModel):
    id: str


class Closed(BaseModel):
    id: str


def _registry() -> Registry:
    registry = Registry(topic_prefix="p.")
    registry.register(Opened, name="acct.opened", key="id", aggregate="acct")
    registry.register(Closed, name="acct.closed", key="id", aggregate="acct")
    return registry


def test_overrides_apply_per_event_type_over_the_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_TOPICS_REPLICATION_FACTOR", "3")
    monkeypatch.setenv("ONCELY_TOPICS_MIN_INSYNC_REPLICAS", "2")
    monkeypatch.setenv("ONCELY_TOPICS_OVERRIDES", '{"acct.opened": {"partitions": 24}}')
    settings = TopicSettings()
    assert settings.layout("acct.opened") == TopicLayout(24, 3, 2)
    assert settings.layout("acct.closed") == TopicLayout(6, 3, 2)
    assert planned_topics(_registry(), settings) == [
        TopicSpec("p.acct.closed", 6, 3, 2),
        TopicSpec("p.acct.opened", 24, 3, 2),
    ]


def test_dead_letter_topics_take_their_source_topics_layout() -> None:
    registry = _registry()
    effects = Effects(registry)
    effects.effect("audit", on=[Opened, Closed])(lambda event, ctx: None)
    effects.effect("notify", on=[Closed])(lambda event, ctx: None)
    settings = TopicSettings(
        replication_factor=3, min_insync_replicas=2, overrides={"acct.opened": {"partitions": 24}}
    )
    assert dead_letter_topics(registry, settings, effects) == [
        TopicSpec("p.acct.closed.audit.dlq", 6, 3, 2),
        TopicSpec("p.acct.closed.notify.dlq", 6, 3, 2),
        TopicSpec("p.acct.opened.audit.dlq", 24, 3, 2),
    ]
    names = [spec.name for spec in planned_topics(registry, settings, effects=effects)]
    assert names == [
        "p.acct.closed",
        "p.acct.closed.audit.dlq",
        "p.acct.closed.notify.dlq",
        "p.acct.opened",
        "p.acct.opened.audit.dlq",
    ]
    other = Effects(Registry(topic_prefix="q."))
    other.registry.register(Opened, name="acct.opened", key="id", aggregate="acct")
    other.effect("audit", on=[Opened])(lambda event, ctx: None)
    with pytest.raises(ConfigurationError, match=r"consumes topic 'q\.acct\.opened', which no"):
        dead_letter_topics(registry, settings, other)


def test_impossible_or_unknown_overrides_are_refused() -> None:
    with pytest.raises(ValidationError, match="exceeds replication_factor"):
        TopicSettings(replication_factor=3, min_insync_replicas=4)
    with pytest.raises(ValidationError, match=r"'acct\.opened'"):
        TopicSettings(
            replication_factor=3,
            min_insync_replicas=2,
            overrides={"acct.opened": {"replication_factor": 1}},
        )
    with pytest.raises(ValidationError):
        TopicSettings(overrides={"acct.opened": {"replicas": 3}})  # a misspelt key
    with pytest.raises(ConfigurationError, match=r"unknown event types: acct\.opend"):
        planned_topics(_registry(), TopicSettings(overrides={"acct.opend": {"partitions": 1}}))


def _live(replicas: int, partitions: int = 6) -> SimpleNamespace:
    return SimpleNamespace(
        partitions={i: SimpleNamespace(replicas=list(range(replicas))) for i in range(partitions)}
    )


def _config(**values: str) -> dict[str, SimpleNamespace]:
    return {name.replace("_", "."): SimpleNamespace(value=value) for name, value in values.items()}


def test_differences_name_every_weakness() -> None:
    spec = TopicSpec("t", 6, 3, 2)
    assert differences(spec, _live(3), _config(min_insync_replicas="2")) == []
    assert differences(spec, _live(1, 3), _config(min_insync_replicas="1")) == [
        "3 partitions, 6 declared",
        "replication factor 1, 3 declared",
        "min.insync.replicas 1, 2 declared",
    ]
    [unwritable] = differences(TopicSpec("t", 6, 1, 1), _live(1), _config(min_insync_replicas="2"))
    assert "every acks=all write fails" in unwritable
    unclean = _config(min_insync_replicas="2", unclean_leader_election_enable="true")
    assert differences(spec, _live(3), unclean) == [
        "unclean.leader.election.enable=true: acknowledged writes may be lost"
    ]


def test_cluster_nodes_share_one_dynamic_quorum(tmp_path: Path) -> None:
    cluster = KafkaCluster(data_dir=tmp_path, size=3)
    quorum = cluster.quorum
    assert quorum.replication_factor == 3 and quorum.min_insync_replicas == 2
    voters = quorum.initial_controllers.split(",")
    assert [voter.split("@")[0] for voter in voters] == ["1", "2", "3"]
    ports = {cluster.node(i).config.port for i in cluster.node_ids} | {
        cluster.node(i).config.controller_port for i in cluster.node_ids
    }
    assert len(ports) == 6
    assert len(cluster.bootstrap_servers.split(",")) == 3
    text = cluster.node(2).config.server_properties()
    assert "node.id=2\n" in text
    assert f"controller.quorum.bootstrap.servers={quorum.bootstrap_servers}\n" in text
    assert "controller.quorum.voters" not in text
    for line in (
        "default.replication.factor=3",
        "min.insync.replicas=2",
        "offsets.topic.replication.factor=3",
        "transaction.state.log.replication.factor=3",
        "transaction.state.log.min.isr=2",
    ):
        assert f"{line}\n" in text
    single = KafkaNodeConfig(data_dir=tmp_path, port=1, controller_port=2).server_properties()
    assert "offsets.topic.replication.factor=1\n" in single and "min.insync.replicas=1\n" in single
    with pytest.raises(DevstackError, match="cannot have replication factor 3"):
        KafkaCluster(data_dir=tmp_path, size=2, replication_factor=3)
    with pytest.raises(DevstackError, match="no node 4"):
        cluster.node(4)
