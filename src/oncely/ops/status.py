"""What ``oncely status`` shows: outbox backlog per topic, effects' progress, tasks by state.

:func:`collect_status` only reads: PostgreSQL in a READ ONLY transaction, Kafka through
metadata, watermarks and committed group offsets (it never joins a group). Without the
application's :class:`~oncely.consumers.effects.Effects` the effect names come from the
receipts table and their consumer groups and topics are unknown, so lag and DLQ depth are
``None``; without Kafka settings they are ``None`` too. :attr:`Status.notes` says why.

Duplicates suppressed are not stored anywhere in the database (a receipt is the evidence of the
one application, the repeats leave no row): they exist only as each consumer's
``oncely_consumer_duplicates_suppressed_total`` metric, so the status reports them as unknown
instead of guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import ClusterMetadata

from oncely.consumers.effects import Effects
from oncely.consumers.offsets import committed_offsets
from oncely.storage.queries import query
from oncely.storage.tables import TASK_STATUSES

#: Answers while a group's coordinator moves or loads (a new group on a fresh broker): retried.
#: "Recently" in the status: the last minute.
RECENT_SECONDS = 60.0
DUPLICATES_NOTE = (
    "duplicates suppressed are not recorded in the database: see each consumer's /metrics "
    "(oncely_consumer_duplicates_suppressed_total)"
)


@dataclass(frozen=True, slots=True)
class TopicStatus:
    """One outbox topic. ``oldest_pending_seconds`` is ``None`` when nothing is pending."""

    topic: str
    pending: int
    oldest_pending_seconds: float | None
    dead: int
    published_last_minute: int


@dataclass(frozen=True, slots=True)
class EffectStatus:
    """One effect. ``group`` is ``None`` for an effect known only from its receipts.

    ``lag``: sum over the effect's partitions of high watermark minus committed offset (minus
    the low watermark where the group never committed: what it would read). ``dlq``: records
    retained in its ``<topic>.<effect>.dlq`` topics (0 when none exists). Both are ``None`` when
    unknown (see :attr:`Status.notes`).
    """

    effect: str
    group: str | None
    topics: list[str]
    applied: int
    applied_last_minute: int
    lag: int | None
    dlq: int | None


@dataclass(frozen=True, slots=True)
class Status:
    """One screen of state; :meth:`to_json` is the ``oncely status --json`` document."""

    database: str
    topics: list[TopicStatus]
    effects: list[EffectStatus]
    tasks: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready data; each effect carries ``duplicates_suppressed: null``."""
        return {
            "database": self.database,
            "topics": [asdict(t) for t in self.topics],
            "effects": [{**asdict(e), "duplicates_suppressed": None} for e in self.effects],
            "tasks": self.tasks,
            "notes": self.notes,
        }


@dataclass(frozen=True, slots=True)
class _EffectRow:
    applied: int
    applied_recently: int


def collect_status(
    engine: sa.Engine,
    *,
    effects: Effects | None,
    kafka_config: dict[str, str | int | float | bool] | None,
    timeout: float = 10.0,
) -> Status:
    """Read the status of the deployment behind ``engine`` (and Kafka, when configured).

    ``effects`` names the effects, their groups and topics; every effect found in the receipts
    is listed too. Raises SQLAlchemy's errors for the database and ``KafkaException`` when the
    broker does not answer within ``timeout`` seconds.
    """
    notes = [DUPLICATES_NOTE]
    params = {"recent_seconds": RECENT_SECONDS}
    with engine.connect().execution_options(postgresql_readonly=True) as conn, conn.begin():
        topic_rows = conn.execute(query("ops_outbox_by_topic"), params).all()
        receipt_rows = conn.execute(query("ops_receipts_by_effect"), params).all()
        task_rows = conn.execute(query("ops_tasks_by_status")).all()
    by_topic = {
        row.topic: TopicStatus(
            row.topic,
            row.pending,
            None if row.oldest_pending_seconds is None else float(row.oldest_pending_seconds),
            row.dead,
            row.published_recently,
        )
        for row in topic_rows
    }
    receipts = {row.effect: _EffectRow(row.applied, row.applied_recently) for row in receipt_rows}
    listed: list[EffectStatus] = []
    if effects is None:
        notes.append("no --app: effects are the names found in the receipts; lag and DLQ unknown")
    else:
        for name in effects.registry.topics():
            by_topic.setdefault(name, TopicStatus(name, 0, None, 0, 0))
        kafka: dict[str, tuple[int, int]] = {}
        if kafka_config is None:
            notes.append("no Kafka bootstrap servers: lag and DLQ unknown")
        else:
            kafka = _kafka_progress(kafka_config, effects, notes, timeout)
        for effect in effects:
            seen = receipts.pop(effect.name, _EffectRow(0, 0))
            lag, dlq = kafka.get(effect.name, (None, None))
            group = effects.group_id(effect.name)
            listed.append(
                EffectStatus(
                    effect.name,
                    group,
                    effect.topics,
                    seen.applied,
                    seen.applied_recently,
                    lag,
                    dlq,
                )
            )
        notes.extend(f"effect {name!r} has receipts but is not in the app" for name in receipts)
    listed.extend(
        EffectStatus(name, None, [], seen.applied, seen.applied_recently, None, None)
        for name, seen in receipts.items()
    )
    tasks = dict.fromkeys(TASK_STATUSES, 0)
    tasks.update({row.status: row.tasks for row in task_rows})
    return Status(
        database=engine.url.render_as_string(hide_password=True),
        topics=[by_topic[name] for name in sorted(by_topic)],
        effects=sorted(listed, key=lambda e: e.effect),
        tasks=tasks,
        notes=notes,
    )


def _kafka_progress(
    config: dict[str, str | int | float | bool],
    effects: Effects,
    notes: list[str],
    timeout: float,
) -> dict[str, tuple[int, int]]:
    """Effect name -> (lag, DLQ records), from watermarks and the groups' committed offsets."""
    # Consumers that never subscribe join no group: one reads metadata and watermarks, one per
    # effect reads its group's committed offsets. (Not AdminClient.list_consumer_group_offsets:
    # librdkafka crashes on a NOT_COORDINATOR answer to it, librdkafka issue #5040.)
    reader = Consumer({**config, "group.id": "oncely-status", "enable.auto.commit": False})
    try:
        metadata = reader.list_topics(timeout=timeout)
        missing = sorted({t for e in effects for t in e.topics if t not in metadata.topics})
        if missing:
            notes.append(f"topic(s) missing in Kafka: {', '.join(missing)}")
        progress: dict[str, tuple[int, int]] = {}
        for effect in effects:
            partitions = _partitions(metadata, effect.topics)
            committed = committed_offsets(
                config, effects.group_id(effect.name), partitions, timeout
            )
            lag = 0
            for tp in partitions:
                low, high = reader.get_watermark_offsets(tp, timeout=timeout)
                position = committed.get((tp.topic, tp.partition), -1)
                lag += max(0, high - (position if position >= 0 else low))
            dlq = 0
            for tp in _partitions(metadata, [effect.dlq_topic(t) for t in effect.topics]):
                low, high = reader.get_watermark_offsets(tp, timeout=timeout)
                dlq += high - low
            progress[effect.name] = (lag, dlq)
        return progress
    finally:
        reader.close()


def _partitions(metadata: ClusterMetadata, topics: Sequence[str]) -> list[TopicPartition]:
    """The partitions of those ``topics`` that exist."""
    return [
        TopicPartition(topic, p)
        for topic in topics
        if topic in metadata.topics
        for p in sorted(metadata.topics[topic].partitions)
    ]
