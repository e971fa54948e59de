"""Topic provisioning: create each event type's topic (and effect topics) before relaying.

The relay never relies on broker auto-creation. :func:`ensure_topics` creates what is missing
with the declared partitions, replication factor and ``min.insync.replicas``, and reports
existing topics whose live configuration is weaker than declared (it never alters them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from oncely.events import Registry
from oncely.settings import TopicSettings


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    min_insync_replicas: int


@dataclass
class EnsureReport:
    created: list[str] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def planned_topics(registry: Registry, settings: TopicSettings) -> list[TopicSpec]:
    """Every topic of ``registry``'s event types and their named effects."""
    names = sorted(
        {t.topic for t in registry}
        | {topic for t in registry for topic in t.effect_topics.values()}
    )
    return [
        TopicSpec(
            name, settings.partitions, settings.replication_factor, settings.min_insync_replicas
        )
        for name in names
    ]


def ensure_topics(
    admin: AdminClient, specs: Sequence[TopicSpec], *, timeout: float = 30
) -> EnsureReport:
    """Create missing topics; report how existing ones differ from their spec."""
    report = EnsureReport()
    metadata = admin.list_topics(timeout=timeout)
    missing = [spec for spec in specs if spec.name not in metadata.topics]
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(
                    spec.name,
                    num_partitions=spec.partitions,
                    replication_factor=spec.replication_factor,
                    config={"min.insync.replicas": str(spec.min_insync_replicas)},
                )
                for spec in missing
            ],
            request_timeout=timeout,
        )
        for name, future in futures.items():
            future.result(timeout)
            report.created.append(name)
    existing = [spec for spec in specs if spec.name in metadata.topics]
    if existing:
        resources = [ConfigResource(ConfigResource.Type.TOPIC, spec.name) for spec in existing]
        configs = {
            resource.name: future.result(timeout)
            for resource, future in admin.describe_configs(resources).items()
        }
        for spec in existing:
            problems = _differences(spec, metadata.topics[spec.name], configs[spec.name])
            if problems:
                report.mismatches.append(f"{spec.name}: {'; '.join(problems)}")
            else:
                report.matching.append(spec.name)
    return report


def _differences(spec: TopicSpec, topic: object, config: dict[str, object]) -> list[str]:
    partitions = getattr(topic, "partitions", {})
    problems = []
    if len(partitions) < spec.partitions:
        problems.append(f"{len(partitions)} partitions, {spec.partitions} declared")
    replicas = min((len(p.replicas) for p in partitions.values()), default=0)
    if replicas < spec.replication_factor:
        problems.append(f"replication factor {replicas}, {spec.replication_factor} declared")
    entry = config.get("min.insync.replicas")
    live = int(getattr(entry, "value", 1) or 1)
    if live < spec.min_insync_replicas:
        problems.append(f"min.insync.replicas {live}, {spec.min_insync_replicas} declared")
    return problems
