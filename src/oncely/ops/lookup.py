"""One event end to end, for the console: its outbox row (decoded with its schema), its Kafka
record, each effect's receipt, its tasks and the events its effects staged.

:func:`lookup_event` answers "this order's email was not sent: where is it?". The row comes
from the outbox (one probe of the primary key), with where the relay stands with it
(:data:`~oncely.storage.stores.outbox.lookup.STATES`). Its Kafka position comes from a receipt
(every receipt records where its effect read the record); when no effect applied it yet and
Kafka settings are given, from Kafka itself: each partition of its topic is read from the
record timestamp of the row's ``created_at`` (the relay's record timestamp) for at most
:data:`KAFKA_RECORDS` records, within ``timeout``. An effect that subscribes to the event's type
and has neither a receipt nor a dead letter of a published event is
:attr:`EffectView.missing`; one whose consumer dead-lettered it is :attr:`EffectView.failed`.

:func:`lookup_key` lists an aggregate key's recent rows: it reads the outbox's primary key over
the last ``within`` (UUIDv7 ids begin with their moment), so its cost is that window's rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from oncely.consumers.effects import Effects
from oncely.errors import OncelyError, error_text
from oncely.ids import lowest_of
from oncely.schemas.codec import Codec
from oncely.settings import ClientConfig
from oncely.storage.stores import dead_lettered
from oncely.storage.stores.dead_lettered import DeadLetter
from oncely.storage.stores.outbox import lookup
from oncely.storage.stores.outbox.lookup import CausedRow, EventRow
from oncely.storage.stores.receipts import Receipt, receipts_of
from oncely.tasks.model import TaskRecord
from oncely.tasks.store import TaskStore
from oncely.wire import EVENT_TYPE_HEADER, SCHEMA_VERSION_HEADER, id_header, trace_context_fields

#: Records read per partition, at most, to find an event no receipt places.
KAFKA_RECORDS = 1000
#: How far after an event the rows its effects staged are looked for.
CAUSED_WITHIN = timedelta(days=1)
#: Rows listed, at most, per key lookup and per caused-by list.
LIMIT = 50


@dataclass(frozen=True, slots=True)
class Position:
    """Where the event's record is on Kafka; ``source`` says who knows: ``receipt`` (an effect
    read it there) or ``kafka`` (found by reading the topic)."""

    topic: str
    partition: int
    offset: int
    source: str


@dataclass(frozen=True, slots=True)
class EffectView:
    """One effect of the application and this event: ``expected`` when it subscribes to the
    event's type; its ``receipt`` once it applied it."""

    effect: str
    expected: bool
    receipt: Receipt | None
    published: bool
    dead_letter: DeadLetter | None = None

    @property
    def missing(self) -> bool:
        """The event was published to an effect that subscribes to it, which neither applied
        it (no receipt) nor dead-lettered it."""
        return (
            self.expected and self.published and self.receipt is None and self.dead_letter is None
        )

    @property
    def failed(self) -> bool:
        """The effect's consumer dead-lettered the event and has not applied it since."""
        return self.receipt is None and self.dead_letter is not None


@dataclass(frozen=True, slots=True)
class EventLookup:
    """Everything known of one event (see the module). ``decoded``: the payload as JSON-ready
    data, or ``None`` with ``decode_error`` saying why (no application given, a type it does
    not know, a value that does not decode). ``position``: ``None`` when unknown (with
    ``position_note`` saying why)."""

    event: EventRow
    decoded: dict[str, Any] | None
    decode_error: str | None
    schema_version: str | None
    trace_id: str | None
    position: Position | None
    position_note: str | None
    effects: list[EffectView]
    tasks: list[TaskRecord]
    caused: list[CausedRow]


def lookup_event(
    engine: sa.Engine,
    event_id: UUID,
    *,
    effects: Effects | None,
    codec: Codec | None = None,
    kafka_config: ClientConfig | None = None,
    timeout: float = 5.0,
) -> EventLookup | None:
    """The event ``event_id`` end to end, or ``None`` when the outbox has no such row (never
    staged, or purged). Reads only; SQLAlchemy's errors propagate, Kafka's become
    :attr:`EventLookup.position_note`."""
    conn = engine.connect().execution_options(
        isolation_level="REPEATABLE READ", postgresql_readonly=True
    )
    with conn, conn.begin():
        row = lookup.event(conn, event_id)
        if row is None:
            return None
        receipts = {r.effect: r for r in receipts_of(conn, event_id)}
        letters = {d.effect: d for d in dead_lettered.of_event(conn, event_id)}
        caused = lookup.caused_by(
            conn,
            event_id,
            low=event_id,
            high=lowest_of(row.created_at + CAUSED_WITHIN),
            limit=LIMIT,
        )
    decoded, decode_error = decoded_payload(
        row, codec or (Codec(registry=effects.registry) if effects else None)
    )
    position, note = _position(row, receipts.values(), kafka_config, timeout)
    published = row.state == "published"
    views = [
        EffectView(
            effect.name,
            row.type in {t.name for t in effect.event_types},
            receipts.get(effect.name),
            published,
            letters.get(effect.name),
        )
        for effect in (effects or ())
    ]
    known = {view.effect for view in views}
    views += [
        EffectView(name, True, receipts.get(name), published, letters.get(name))
        for name in sorted((receipts.keys() | letters.keys()) - known)
    ]
    return EventLookup(
        event=row,
        decoded=decoded,
        decode_error=decode_error,
        schema_version=row.headers.get(SCHEMA_VERSION_HEADER),
        trace_id=_trace_id(row.trace_context),
        position=position,
        position_note=note,
        effects=sorted(views, key=lambda v: v.effect),
        tasks=TaskStore(engine=engine).of_event(event_id, limit=LIMIT),
        caused=caused,
    )


def lookup_key(
    engine: sa.Engine,
    key: str,
    *,
    within: timedelta = timedelta(days=1),
    limit: int = LIMIT,
    now: datetime | None = None,
) -> list[EventRow]:
    """The newest ``limit`` rows of aggregate key ``key`` created in the last ``within``."""
    end = now or datetime.now(UTC)
    with engine.connect() as conn:
        return lookup.of_key(
            conn,
            key,
            low=lowest_of(end - within),
            high=lowest_of(end + timedelta(minutes=1)),
            limit=limit,
        )


def decoded_payload(row: EventRow, codec: Codec | None) -> tuple[dict[str, Any] | None, str | None]:
    """The row's payload decoded with its schema as JSON-ready data, or ``None`` and why not."""
    if codec is None:
        return None, "no application given (--app): the payload is shown as stored"
    try:
        event = codec.decode(row.payload, {**row.headers, EVENT_TYPE_HEADER: row.type})
    except OncelyError as exc:  # DecodeError, UnknownEventTypeError: shown, never fatal
        return None, error_text(exc)
    return event.model_dump(mode="json"), None


def _trace_id(trace_context: str | None) -> str | None:
    parent = trace_context_fields(trace_context).get("traceparent", "")
    parts = parent.split("-")
    return parts[1] if len(parts) == 4 else None


def _position(
    row: EventRow,
    receipts: Any,
    kafka_config: ClientConfig | None,
    timeout: float,
) -> tuple[Position | None, str | None]:
    for receipt in receipts:
        if (
            receipt.topic is not None
            and receipt.partition is not None
            and receipt.offset is not None
        ):
            return Position(receipt.topic, receipt.partition, receipt.offset, "receipt"), None
    if row.state != "published":
        return None, f"not on Kafka: the row is {row.state}"
    if kafka_config is None:
        return None, "no receipt places it, and Kafka was not asked (no bootstrap servers)"
    try:
        found = _find_on_kafka(row, kafka_config, timeout)
    except KafkaException as exc:  # shown, never fatal to the page
        return None, f"Kafka did not answer: {error_text(exc)}"
    if found is None:
        return None, (
            f"not found in the first {KAFKA_RECORDS} records of each partition of {row.topic} "
            "from its timestamp (retention may have deleted it)"
        )
    return found, None


def _find_on_kafka(row: EventRow, config: ClientConfig, timeout: float) -> Position | None:
    consumer = Consumer(
        {
            **config,
            # Never subscribes nor commits: the group is only a required setting.
            "group.id": "oncely-lookup",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    try:
        topics = consumer.list_topics(row.topic, timeout=timeout).topics
        if row.topic not in topics or topics[row.topic].error is not None:
            return None
        stamp = int(row.created_at.timestamp() * 1000)
        starts = consumer.offsets_for_times(
            [TopicPartition(row.topic, p, stamp) for p in topics[row.topic].partitions],
            timeout=timeout,
        )
        assignment = [s for s in starts if s.offset >= 0]
        if not assignment:
            return None
        consumer.assign(assignment)
        wanted, left = str(row.id), dict.fromkeys((s.partition for s in assignment), KAFKA_RECORDS)
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=0.2):
                partition = message.partition()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        left.pop(partition, None)  # type: ignore[arg-type]
                    continue
                if id_header(message) == wanted:
                    return Position(row.topic, partition or 0, message.offset() or 0, "kafka")
                if partition in left:
                    left[partition] -= 1
                    if not left[partition]:
                        del left[partition]
        return None
    finally:
        consumer.close()
