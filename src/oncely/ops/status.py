"""What ``oncely status`` shows: outbox backlog per topic and shard, parked keys, shard leases,
effects' progress, tasks by state.

The backlog comes from the relay's progress rows (``oncely_relay_shards``): a row is
*unpublished* while its shard's recorded progress has not passed it (committed, not yet
acknowledged by Kafka), counted per topic and shard with the age of the oldest. Rows the
progress has passed but that wait behind a parked key are counted apart: ``dead`` (a row that
failed for good parks its key), ``delayed`` (a row whose ``available_at`` is ahead) and
``held_rows`` behind them (``oncely_relay_parked`` / ``oncely_relay_held``). Published rows
leave no trace in the database: the rate is the relay's ``oncely_relay_published_total``.

:func:`collect_status` only reads: PostgreSQL in a READ ONLY transaction, Kafka through
metadata, watermarks and committed group offsets (it never joins a group). Without the
application's :class:`~oncely.consumers.effects.Effects` the effect names come from the
receipts table and their consumer groups and topics are unknown, so lag and DLQ depth are
``None``; without Kafka settings they are ``None`` too. :attr:`Status.notes` says why.

Kafka is read last, within one time budget: when it does not answer (down, unreachable,
refusing the credentials, timing out on a partition), everything the database knows is still
reported, lag and DLQ depth are ``None`` and :attr:`Status.kafka_error` says why in one line.

With the application's effects, each effect's completeness is read in the same snapshot
(:attr:`Status.completeness`: events older than ``ONCELY_COMPLETENESS_GRACE_SECONDS`` with
neither its receipt nor a dead letter; see :mod:`oncely.consumers.completeness`).

Duplicates suppressed are not stored anywhere in the database (a receipt is the evidence of the
one application, the repeats leave no row): they exist only as each consumer's
``oncely_consumer_duplicates_suppressed_total`` metric, so the status reports them as unknown
instead of guessing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ClusterMetadata

from oncely.consumers.completeness import EffectCompleteness, check_effects
from oncely.consumers.effects import Effects
from oncely.consumers.offsets import committed_offsets
from oncely.security import AuthWatch, KafkaAuthenticationError, wait_for_metadata
from oncely.settings import ClientConfig, CompletenessSettings
from oncely.storage.stores.outbox import relay as outbox
from oncely.storage.stores.outbox.relay import ShardBacklog, ShardState
from oncely.storage.stores.outbox.reports import ParkedOfTopic, parked_by_topic
from oncely.storage.stores.receipts import EffectReceipts, applied_by_effect
from oncely.tasks.store import count_by_status

#: "Recently" in the status: the last minute.
RECENT_SECONDS = 60.0
#: The longest the status waits for Kafka, all its questions together (it gives up at once
#: when every broker refuses the connection).
KAFKA_SECONDS = 10.0
DUPLICATES_NOTE = (
    "duplicates suppressed are not recorded in the database: see each consumer's /metrics "
    "(oncely_consumer_duplicates_suppressed_total)"
)


@dataclass(frozen=True, slots=True)
class TopicStatus:
    """One outbox topic.

    ``unpublished``: committed rows no shard's progress has passed yet, and the age of the
    oldest (``None`` when there is none). ``dead`` and ``delayed``: keys parked by a dead or a
    delayed row; ``held_keys``: all its parked keys; ``held_rows``: rows read behind them,
    waiting; ``requested``: dead rows asked to be requeued or skipped that no relay has carried
    out yet (no relay running, or it does not hold the shard). While the topic is missing or
    not authorised: ``blocked_rows`` wait for it (they are published by themselves once it
    exists) since ``blocked_since``, and ``blocked_error`` says which.
    """

    topic: str
    unpublished: int
    oldest_unpublished_seconds: float | None
    dead: int
    delayed: int
    held_keys: int
    held_rows: int
    requested: int
    blocked_rows: int = 0
    blocked_since: str | None = None
    blocked_error: str | None = None


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One shard's lease and progress. ``leased``: a relay (``owner``) holds it now; ``epoch``
    counts takeovers. ``progress_age_seconds``: since its progress was last recorded.
    ``exactly_once``: whether its owner runs in exactly-once mode (``False``: at least once),
    as the owner's last heartbeat said; ``None`` when it has no owner or its heartbeats are
    gone."""

    shard: int
    owner: str | None
    epoch: int
    leased: bool
    progress_age_seconds: float
    unpublished: int
    oldest_unpublished_seconds: float | None
    exactly_once: bool | None = None


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
    """One screen of state; :meth:`to_json` is the ``oncely status --json`` document.

    ``kafka_error``: why Kafka's columns (each effect's lag and DLQ) are unknown although Kafka
    was asked, in one line; ``None`` when it answered or was not asked (see ``notes``).
    ``completeness``: each of the app's effects' missing events, by effect name (empty without
    the app's effects).
    """

    database: str
    topics: list[TopicStatus]
    backlog: list[ShardBacklog]
    shards: list[ShardStatus]
    effects: list[EffectStatus]
    tasks: dict[str, int]
    notes: list[str] = field(default_factory=list)
    kafka_error: str | None = None
    completeness: list[EffectCompleteness] = field(default_factory=list)

    @property
    def relays(self) -> dict[str, list[int]]:
        """Each relay holding shards now -> the shards it holds."""
        held: dict[str, list[int]] = {}
        for shard in self.shards:
            if shard.leased and shard.owner is not None:
                held.setdefault(shard.owner, []).append(shard.shard)
        return held

    @property
    def modes(self) -> dict[str, bool | None]:
        """Each relay holding shards now -> whether it runs in exactly-once mode (``None``:
        unknown, its heartbeats are gone)."""
        return {
            shard.owner: shard.exactly_once
            for shard in self.shards
            if shard.leased and shard.owner is not None
        }

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready data; each effect carries ``duplicates_suppressed: null``."""
        return {
            "database": self.database,
            "topics": [asdict(t) for t in self.topics],
            "backlog": [asdict(b) for b in self.backlog],
            "shards": [asdict(s) for s in self.shards],
            "effects": [{**asdict(e), "duplicates_suppressed": None} for e in self.effects],
            "tasks": self.tasks,
            "notes": self.notes,
            "kafka_error": self.kafka_error,
            "completeness": [c.to_json() for c in self.completeness],
        }


def collect_status(
    engine: sa.Engine,
    *,
    effects: Effects | None,
    kafka_config: ClientConfig | None,
    timeout: float = KAFKA_SECONDS,
    completeness: CompletenessSettings | None = None,
    check_completeness: bool = True,
) -> Status:
    """Read the status of the deployment behind ``engine`` (and Kafka, when configured).

    ``effects`` names the effects, their groups and topics; every effect found in the receipts
    is listed too. The completeness of ``effects`` is checked as ``completeness`` says
    (default: ``ONCELY_COMPLETENESS_*``; its interval does not apply here), unless
    ``check_completeness`` is false (a caller refreshing often checks it less often).

    Raises SQLAlchemy's errors for the database. Kafka gets ``timeout`` seconds
    for all its answers; when it fails, the status is returned without them, with
    :attr:`Status.kafka_error` saying why (``KafkaException`` still escapes for a client
    configuration librdkafka refuses: a mistake to fix, not an outage).
    """
    notes = [DUPLICATES_NOTE]
    # One REPEATABLE READ snapshot: the backlog, parked keys and leases agree with each other.
    conn = engine.connect().execution_options(
        isolation_level="REPEATABLE READ", postgresql_readonly=True
    )
    with conn, conn.begin():
        backlog = outbox.backlog(conn)
        shard_rows = outbox.shards(conn)
        parked_rows = parked_by_topic(conn)
        receipt_rows = applied_by_effect(conn, recent_seconds=RECENT_SECONDS)
        task_counts = count_by_status(conn)
        complete = (
            []
            if effects is None or not check_completeness
            else check_effects(conn, effects, completeness or CompletenessSettings())
        )
    by_topic = _topics(backlog, parked_rows)
    notes += [
        f"{t.blocked_error} since {t.blocked_since}: {t.blocked_rows} rows "
        "held, published by the relay once it exists (`oncely topics ensure`)"
        for t in by_topic.values()
        if t.blocked_rows and t.blocked_since is not None
    ]
    shards = _shards(shard_rows, backlog)
    idle = [s.shard for s in shards if not s.leased and s.unpublished]
    if idle:
        notes.append(
            f"{len(idle)} shard(s) with unpublished rows are held by no relay "
            f"({', '.join(map(str, idle))}): is `oncely relay run` running?"
        )
    receipts = {row.effect: row for row in receipt_rows}
    kafka_error = None
    if effects is None:
        notes.append("no --app: effects are the names found in the receipts; lag and DLQ unknown")
        listed: list[EffectStatus] = []
    else:
        for name in effects.registry.topics():
            by_topic.setdefault(name, TopicStatus(name, 0, None, 0, 0, 0, 0, 0))
        listed, kafka_error = _app_effects(effects, receipts, kafka_config, notes, timeout)
    listed.extend(
        EffectStatus(name, None, [], seen.applied, seen.applied_recently, None, None)
        for name, seen in receipts.items()
    )
    return Status(
        database=engine.url.render_as_string(hide_password=True),
        topics=[by_topic[name] for name in sorted(by_topic)],
        backlog=backlog,
        shards=shards,
        effects=sorted(listed, key=lambda e: e.effect),
        tasks=task_counts,
        notes=notes,
        kafka_error=kafka_error,
        completeness=sorted(complete, key=lambda c: c.effect),
    )


def _shards(rows: Sequence[ShardState], backlog: Sequence[ShardBacklog]) -> list[ShardStatus]:
    """Each shard's lease and progress, with its share of the backlog."""
    return [
        ShardStatus(
            shard=row.shard,
            owner=row.owner,
            epoch=row.epoch,
            leased=bool(row.leased),
            progress_age_seconds=float(row.progress_age_seconds),
            unpublished=sum(b.unpublished for b in backlog if b.shard == row.shard),
            oldest_unpublished_seconds=max(
                (b.oldest_unpublished_seconds for b in backlog if b.shard == row.shard),
                default=None,
            ),
            exactly_once=row.exactly_once,
        )
        for row in rows
    ]


def _app_effects(
    effects: Effects,
    receipts: dict[str, EffectReceipts],
    kafka_config: ClientConfig | None,
    notes: list[str],
    timeout: float,
) -> tuple[list[EffectStatus], str | None]:
    """The app's effects with their receipts (taken out of ``receipts``), lag and DLQ; and why
    Kafka did not answer (``None`` when it did or was not asked)."""
    kafka: dict[str, tuple[int, int]] = {}
    kafka_error = None
    if kafka_config is None:
        notes.append("no Kafka bootstrap servers: lag and DLQ unknown")
    else:
        try:
            kafka = _kafka_progress(kafka_config, effects, notes, timeout)
        except _KafkaUnavailableError as exc:
            kafka_error = str(exc)
    listed = []
    for effect in effects:
        seen = receipts.pop(effect.name, EffectReceipts(effect.name, 0, 0))
        lag, dlq = kafka.get(effect.name, (None, None))
        group = effects.group_id(effect.name)
        listed.append(
            EffectStatus(
                effect.name, group, effect.topics, seen.applied, seen.applied_recently, lag, dlq
            )
        )
    notes.extend(f"effect {name!r} has receipts but is not in the app" for name in receipts)
    return listed, kafka_error


def _utc(moment: datetime | None) -> str | None:
    """ISO-8601 in UTC, to the second, with ``Z``."""
    if moment is None:
        return None
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _topics(
    backlog: Sequence[ShardBacklog], parked: Sequence[ParkedOfTopic]
) -> dict[str, TopicStatus]:
    """Per topic: the backlog summed over shards, and its parked keys and held rows."""
    unpublished: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for item in backlog:
        unpublished[item.topic] = unpublished.get(item.topic, 0) + item.unpublished
        oldest[item.topic] = max(oldest.get(item.topic, 0.0), item.oldest_unpublished_seconds)
    by_parked = {row.topic: row for row in parked}
    topics: dict[str, TopicStatus] = {}
    for name in sorted(set(unpublished) | set(by_parked)):
        row = by_parked.get(name)
        topics[name] = TopicStatus(
            topic=name,
            unpublished=unpublished.get(name, 0),
            oldest_unpublished_seconds=oldest.get(name),
            dead=row.dead if row else 0,
            delayed=row.delayed if row else 0,
            held_keys=row.held_keys if row else 0,
            held_rows=row.held_rows if row else 0,
            requested=row.requested if row else 0,
            blocked_rows=row.blocked_rows if row else 0,
            blocked_since=_utc(row.blocked_since) if row else None,
            blocked_error=row.blocked_error if row else None,
        )
    return topics


class _KafkaUnavailableError(Exception):
    """Kafka did not answer the status's questions; the message says why, in one line."""


def _kafka_progress(
    config: ClientConfig,
    effects: Effects,
    notes: list[str],
    timeout: float,
) -> dict[str, tuple[int, int]]:
    """Effect name -> (lag, DLQ records), from watermarks and the groups' committed offsets,
    all within ``timeout`` seconds. Raises :class:`_KafkaUnavailableError` when Kafka does not
    answer in time (or refuses the credentials)."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out"))
        return remaining

    # Clients are created before the first question: librdkafka refusing the configuration is
    # a mistake to fix, not an outage, and escapes.
    watch = AuthWatch()
    admin_config: ClientConfig = {**config, "error_cb": watch}
    admin = AdminClient(admin_config)
    # Consumers that never subscribe join no group: one reads watermarks, one per effect reads
    # its group's committed offsets. (Not AdminClient.list_consumer_group_offsets: librdkafka
    # crashes on a NOT_COORDINATOR answer to it, librdkafka issue #5040.)
    reader = Consumer({**config, "group.id": "oncely-status", "enable.auto.commit": False})
    try:
        metadata = wait_for_metadata(admin, watch, timeout=left(), until_brokers_down=True)
        missing = sorted({t for e in effects for t in e.topics if t not in metadata.topics})
        if missing:
            notes.append(f"topic(s) missing in Kafka: {', '.join(missing)}")
        progress: dict[str, tuple[int, int]] = {}
        for effect in effects:
            partitions = _partitions(metadata, effect.topics)
            committed = committed_offsets(config, effects.group_id(effect.name), partitions, left())
            lag = 0
            for tp in partitions:
                low, high = reader.get_watermark_offsets(tp, timeout=left())
                position = committed.get((tp.topic, tp.partition), -1)
                lag += max(0, high - (position if position >= 0 else low))
            dlq = 0
            for tp in _partitions(metadata, [effect.dlq_topic(t) for t in effect.topics]):
                low, high = reader.get_watermark_offsets(tp, timeout=left())
                dlq += high - low
            progress[effect.name] = (lag, dlq)
        return progress
    except KafkaAuthenticationError as exc:
        raise _KafkaUnavailableError(str(exc)) from None
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        cause = error.str() if isinstance(error, KafkaError) else str(exc)
        waited = "" if watch.brokers_down else f" within {timeout:g} s"
        raise _KafkaUnavailableError(
            f"no broker answered at {config.get('bootstrap.servers')}{waited} ({cause})"
        ) from None
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
