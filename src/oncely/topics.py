"""Topic provisioning: create each event type's topic before relaying.

Effect consumers' dead-letter topics ``<topic>.<effect>.dlq`` are provisioned the same way
(:func:`dead_letter_topics`): each takes its source topic's declared partitions, replication
factor and ``min.insync.replicas``, so a per-event-type override applies to its dead-letter
topics too.

The relay never relies on broker auto-creation. :func:`ensure_topics` creates what is missing
with the declared partitions, replication factor and ``min.insync.replicas``, and reports
existing topics whose live configuration is weaker than declared (it never alters them):

- fewer partitions than declared (more are not reported: they are not weaker, though keys
  would map to other partitions than in a topic created as declared);
- a partition with fewer replicas than the declared replication factor;
- a lower effective ``min.insync.replicas`` (the topic's own or the brokers' default);
- ``min.insync.replicas`` above the live replication factor (``acks=all`` writes always fail);
- ``unclean.leader.election.enable=true`` (a lagging replica may become leader and drop
  acknowledged records, which ``acks=all`` is meant to rule out).

Topics changing under it (deleted or created by another job between the listing and the
check) are planned again from a fresh listing rather than failing the run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from oncely.errors import ConfigurationError
from oncely.events import Registry
from oncely.settings import TopicSettings
from oncely.wire import dlq_topic, progress_topic


class Consuming(Protocol):
    """What provisioning needs of an effect: its name and the topics it consumes."""

    @property
    def name(self) -> str: ...

    @property
    def topics(self) -> Iterable[str]: ...


@dataclass(frozen=True)
class TopicSpec:
    """What one topic is declared to be."""

    name: str
    partitions: int
    replication_factor: int
    min_insync_replicas: int
    #: Other topic settings it is created with (e.g. ``cleanup.policy``).
    config: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``6 partitions, replication factor 3, min.insync.replicas 2``."""
        return (
            f"{self.partitions} partitions, replication factor {self.replication_factor}, "
            f"min.insync.replicas {self.min_insync_replicas}"
        ) + "".join(f", {name} {value}" for name, value in self.config.items())


def progress_topic_spec(prefix: str, settings: TopicSettings) -> TopicSpec:
    """The progress topic of relays in exactly-once mode with transactional id ``prefix``:
    one partition, compacted (each shard's last record kept), replicated as the others."""
    return TopicSpec(
        progress_topic(prefix),
        1,
        settings.replication_factor,
        settings.min_insync_replicas,
        {"cleanup.policy": "compact"},
    )


@dataclass
class EnsureReport:
    """Topic names created or found as declared; ``"<topic>: <why>"`` for the others."""

    created: list[str] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    #: Topics that could not be created (e.g. more replicas declared than there are brokers).
    failed: list[str] = field(default_factory=list)


def planned_topics(
    registry: Registry, settings: TopicSettings, *, effects: Iterable[Consuming] = ()
) -> list[TopicSpec]:
    """Every topic of ``registry``'s event types, sorted by name, and
    the dead-letter topics of ``effects`` (see :func:`dead_letter_topics`).

    Each event type's topics take ``settings.layout(name)`` (its override over the global
    values); a topic shared by several event types takes the largest value of each. Raises
    :class:`ConfigurationError` when ``settings.overrides`` names an event type the registry
    does not have (most likely a typo that would silently apply the global values).
    """
    specs = _event_topics(registry, settings)
    dead = dead_letter_topics(registry, settings, effects)
    return sorted([*specs, *dead], key=lambda spec: spec.name)


def dead_letter_topics(
    registry: Registry, settings: TopicSettings, effects: Iterable[Consuming]
) -> list[TopicSpec]:
    """The dead-letter topics ``<topic>.<effect>.dlq`` of ``effects``, sorted by name.

    Each takes the planned layout of its source topic (partitions, replication factor and
    ``min.insync.replicas``, with the overrides of the event types on that topic).

    Raises:
        ConfigurationError: as :func:`planned_topics`, or an effect consumes a topic that no
            event type of ``registry`` has (the effects app is over another registry).
    """
    sources = {spec.name: spec for spec in _event_topics(registry, settings)}
    specs: dict[str, TopicSpec] = {}
    for effect in effects:
        for topic in effect.topics:
            source = sources.get(topic)
            if source is None:
                raise ConfigurationError(
                    f"effect {effect.name!r} consumes topic {topic!r}, which no event type of "
                    "the registry has: pass the registry the effects app is built on"
                )
            name = dlq_topic(topic, effect.name)
            specs[name] = TopicSpec(
                name, source.partitions, source.replication_factor, source.min_insync_replicas
            )
    return [specs[name] for name in sorted(specs)]


def _event_topics(registry: Registry, settings: TopicSettings) -> list[TopicSpec]:
    unknown = sorted(name for name in settings.overrides if name not in registry)
    if unknown:
        known = ", ".join(sorted(t.name for t in registry)) or "none"
        raise ConfigurationError(
            f"ONCELY_TOPICS_OVERRIDES names unknown event types: {', '.join(unknown)} "
            f"(registered: {known})"
        )
    layouts: dict[str, tuple[int, int, int]] = {}
    for event_type in registry:
        layout = tuple(settings.layout(event_type.name))
        before = layouts.get(event_type.topic, (0, 0, 0))
        layouts[event_type.topic] = (
            max(before[0], layout[0]),
            max(before[1], layout[1]),
            max(before[2], layout[2]),
        )
    return [TopicSpec(name, *layouts[name]) for name in sorted(layouts)]


def ensure_topics(
    admin: AdminClient, specs: Sequence[TopicSpec], *, timeout: float = 30, attempts: int = 4
) -> EnsureReport:
    """Create missing topics; report how existing ones differ from their spec.

    Topics may change under it (another job, an operator): one created by someone else after
    the listing is checked like any existing topic, and one deleted (or being deleted) after
    the listing is planned again from a fresh listing, up to ``attempts`` rounds a moment
    apart. A topic still changing after that is reported in ``failed`` (one line: what
    happened, and to run again), never raised.

    Raises:
        KafkaException: the brokers could not be reached within ``timeout`` seconds, or
            refused a request for another reason than the topic being gone.
    """
    report = EnsureReport()
    pending = list(specs)
    raced: list[tuple[TopicSpec, str]] = []
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(2.0, 0.25 * 2**attempt))
        raced = _ensure_round(admin, pending, report, timeout)
        pending = [spec for spec, _ in raced]
        if not pending:
            break
    report.failed.extend(
        f"{spec.name}: {why} while being checked ({attempts} attempts); run again"
        for spec, why in raced
    )
    return report


def _ensure_round(
    admin: AdminClient, specs: Sequence[TopicSpec], report: EnsureReport, timeout: float
) -> list[tuple[TopicSpec, str]]:
    """One listing, creation and check of ``specs`` into ``report``; returns the specs whose
    topic changed meanwhile (with what was seen), to be planned again."""
    metadata = admin.list_topics(timeout=timeout)
    existing = [spec for spec in specs if spec.name in metadata.topics]
    missing = [spec for spec in specs if spec.name not in metadata.topics]
    existing += _create(admin, missing, report, timeout)
    if not existing:
        return []
    if any(spec.name not in metadata.topics for spec in existing):  # created meanwhile
        metadata = admin.list_topics(timeout=timeout)
    raced: list[tuple[TopicSpec, str]] = []
    present = []
    for spec in existing:
        topic = metadata.topics.get(spec.name)
        if topic is None:  # "already exists" when created, gone now: being deleted
            raced.append((spec, "deleted by someone else"))
        elif topic.error is not None:
            raced.append((spec, f"unavailable ({topic.error.str()})"))
        else:
            present.append(spec)
    configs = _configs(admin, present, timeout)
    for spec in present:
        if spec.name not in configs:  # listed, then gone when described
            raced.append((spec, "deleted by someone else"))
            continue
        problems = differences(spec, metadata.topics[spec.name], configs[spec.name])
        if problems:
            report.mismatches.append(f"{spec.name}: {'; '.join(problems)}")
        else:
            report.matching.append(spec.name)
    return raced


def _create(
    admin: AdminClient, specs: Sequence[TopicSpec], report: EnsureReport, timeout: float
) -> list[TopicSpec]:
    """Create ``specs`` as declared into ``report``; return those someone created first."""
    if not specs:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                spec.name,
                num_partitions=spec.partitions,
                replication_factor=spec.replication_factor,
                config={"min.insync.replicas": str(spec.min_insync_replicas), **spec.config},
            )
            for spec in specs
        ],
        request_timeout=timeout,
    )
    existed = []
    for spec in specs:
        try:
            futures[spec.name].result(timeout)
        except KafkaException as exc:
            if _code(exc) == KafkaError.TOPIC_ALREADY_EXISTS:
                existed.append(spec)  # created meanwhile by someone else: check it
                continue
            error = exc.args[0]
            text = error.str() if isinstance(error, KafkaError) else str(exc)
            report.failed.append(f"{spec.name}: {text}")
            continue
        report.created.append(spec.name)
    return existed


def _configs(admin: AdminClient, specs: Sequence[TopicSpec], timeout: float) -> dict[str, Any]:
    """The live configuration of each of ``specs``' topics (those gone meanwhile left out)."""
    configs: dict[str, Any] = {}
    if not specs:
        return configs
    resources = [ConfigResource(ConfigResource.Type.TOPIC, spec.name) for spec in specs]
    for resource, future in admin.describe_configs(resources, request_timeout=timeout).items():
        try:
            configs[resource.name] = future.result(timeout)
        except KafkaException as exc:
            if _code(exc) != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
    return configs


def _code(exc: KafkaException) -> int | None:
    error = exc.args[0] if exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


def differences(spec: TopicSpec, topic: Any, config: Mapping[str, Any]) -> list[str]:
    """Where a live topic (``TopicMetadata`` and ``describe_configs`` entries) is weaker."""
    partitions = getattr(topic, "partitions", {})
    problems = []
    if len(partitions) < spec.partitions:
        problems.append(f"{len(partitions)} partitions, {spec.partitions} declared")
    replicas = min((len(p.replicas) for p in partitions.values()), default=0)
    if replicas < spec.replication_factor:
        problems.append(f"replication factor {replicas}, {spec.replication_factor} declared")
    min_isr = int(_value(config, "min.insync.replicas") or 1)
    if min_isr < spec.min_insync_replicas:
        problems.append(f"min.insync.replicas {min_isr}, {spec.min_insync_replicas} declared")
    if replicas and min_isr > replicas:
        problems.append(
            f"min.insync.replicas {min_isr} exceeds the {replicas} replicas: every acks=all "
            "write fails"
        )
    if (_value(config, "unclean.leader.election.enable") or "false").lower() == "true":
        problems.append("unclean.leader.election.enable=true: acknowledged writes may be lost")
    return problems


def _value(config: Mapping[str, Any], name: str) -> str | None:
    value = getattr(config.get(name), "value", None)
    return str(value) if value is not None else None
