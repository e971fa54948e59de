"""Test helpers shared by integration and acceptance tests: raw outbox rows, topic read-back."""

from __future__ import annotations

import contextlib
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition

from oncely import testing
from oncely.consumers.effects import Effects
from oncely.consumers.runner import EffectConsumer
from oncely.relay import Relay
from oncely.runtime.tracing import Tracing
from oncely.settings import ConsumerSettings, KafkaSettings, RelaySettings
from oncely.storage import outbox


def outbox_rows(
    count: int, *, topics: Sequence[str], keys: int, payload: bytes = b"x" * 200
) -> list[dict[str, object]]:
    """Rows as a producer would stage them: key i % keys, topic by key, payload as given."""
    rows = []
    for i in range(count):
        key = i % keys
        rows.append(
            {
                "id": uuid.uuid4(),
                "aggregatetype": "account",
                "aggregateid": f"key-{key}",
                "type": "test.event",
                "topic": topics[(i // keys) % len(topics)],
                "payload": payload,
                "headers": {"content-type": "application/octet-stream", "n": str(i)},
                "event_key": f"event-{i}-{uuid.uuid4().hex[:6]}",
            }
        )
    return rows


def insert_rows(engine: sa.Engine, rows: Sequence[dict[str, object]]) -> None:
    with engine.begin() as conn:
        for start in range(0, len(rows), 1000):
            conn.execute(sa.insert(outbox), list(rows[start : start + 1000]))


def set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Change one setting of ``topic`` on the broker (e.g. raise ``max.message.bytes``)."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource("topic", topic, incremental_configs=[entry])
    admin.incremental_alter_configs([resource])[resource].result(30)


class StatementSpy(list[str]):
    """The statements sent to PostgreSQL from threads other than the test's own (a relay's, a
    consumer's), in order: psycopg's ``Cursor.execute`` and ``AsyncCursor.execute`` are wrapped,
    and every statement, through SQLAlchemy or straight on the driver, goes through them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        execute = psycopg.Cursor.execute

        def spied(cursor: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                self.append(query if isinstance(query, str) else repr(query))
            return execute(cursor, query, *args, **kwargs)

        async_execute = psycopg.AsyncCursor.execute

        async def async_spied(
            cursor: psycopg.AsyncCursor[Any], query: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if threading.current_thread() is not threading.main_thread():
                self.append(query if isinstance(query, str) else repr(query))
            return await async_execute(cursor, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", spied)
        monkeypatch.setattr(psycopg.AsyncCursor, "execute", async_spied)


def fast_settings(**overrides: object) -> RelaySettings:
    values: dict[str, object] = {
        "lease_seconds": 10.0,
        "poll_interval_seconds": 0.2,
        "initial_backoff_seconds": 0.2,
        "max_backoff_seconds": 2.0,
        "delivery_timeout_ms": 10_000,
        "purge_interval_seconds": 3600.0,
        "shutdown_timeout_seconds": 15.0,
        **overrides,
    }
    return RelaySettings(**values)  # type: ignore[arg-type]


def running_relay(
    engine: sa.Engine,
    bootstrap: str,
    settings: RelaySettings,
    *,
    tracing: Tracing | None = None,
    kafka: KafkaSettings | None = None,
) -> contextlib.AbstractContextManager[Relay]:
    """:func:`oncely.testing.running_relay` on a PLAINTEXT ``bootstrap`` (or ``kafka``)."""
    kafka = kafka or KafkaSettings(bootstrap_servers=bootstrap)
    return testing.running_relay(engine, kafka, settings, tracing=tracing)


def wait_until(predicate: object, *, timeout: float, interval: float = 0.2) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        time.sleep(interval)


def count_published(engine: sa.Engine) -> int:
    """Rows the relay has recorded as acknowledged (held and dead rows are not counted)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    """
                    SELECT count(*) FROM oncely_outbox AS o
                    JOIN oncely_relay_shards AS s ON s.shard = o.shard
                    WHERE oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
                      AND o.id NOT IN (SELECT event_id FROM oncely_relay_held)
                      AND o.id NOT IN (SELECT event_id FROM oncely_relay_parked)
                    """
                )
            ).scalar_one()
        )


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, bytes]
    #: The record's timestamp in ms (the producer's, on CreateTime topics).
    timestamp: int = 0
    #: Every header name in order, repeated names included (``headers`` keeps the last value).
    header_names: tuple[str, ...] = ()


def read_topics(bootstrap: str, topics: Sequence[str], *, timeout: float = 30) -> list[Record]:
    """Every record now in ``topics`` (read from the beginning up to the high watermarks)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    records: list[Record] = []
    try:
        metadata = consumer.list_topics(timeout=10)
        ends: dict[tuple[str, int], int] = {}
        assignment = []
        for topic in topics:
            for partition in metadata.topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=10
                )
                if high > low:
                    ends[(topic, partition)] = high
                    assignment.append(TopicPartition(topic, partition, low))
        consumer.assign(assignment)
        deadline = time.monotonic() + timeout
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            topic, partition, offset = msg.topic() or "", msg.partition() or 0, msg.offset() or 0
            records.append(
                Record(
                    topic,
                    partition,
                    offset,
                    (msg.key() or b"").decode(),
                    msg.value() or b"",
                    {k: bytes(v or b"") for k, v in msg.headers() or []},  # type: ignore[misc]
                    msg.timestamp()[1],
                    tuple(name for name, _ in msg.headers() or []),
                )
            )
            if offset + 1 >= ends.get((topic, partition), 0):
                ends.pop((topic, partition), None)
        assert not ends, f"partitions not read to the end: {ends}"
    finally:
        consumer.close()
    return records


def publish_events(
    bootstrap: str, codec: object, events: Sequence[tuple[uuid.UUID | str, object]]
) -> None:
    """Produce events as the relay would (id and eventType headers, codec value), in order; an
    id given as text goes in the ``id`` header as it is spelled."""
    from confluent_kafka import Producer
    from pydantic import BaseModel

    from oncely.schemas.codec import Codec

    assert isinstance(codec, Codec)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for event_id, event in events:
        assert isinstance(event, BaseModel)
        event_type = codec.registry.for_model(type(event))
        value, headers = codec.encode(event)
        producer.produce(
            event_type.topic,
            key=event_type.key_of(event).encode(),
            value=value,
            headers=[("id", str(event_id)), ("eventType", event_type.name), *headers.items()],
        )
    assert producer.flush(30) == 0


def running_consumers(
    effects: Effects,
    names: Sequence[str],
    engine: sa.Engine,
    bootstrap: str,
    *,
    lanes: int = 1,
    tracing: Tracing | None = None,
    **settings: object,
) -> contextlib.AbstractContextManager[list[EffectConsumer]]:
    """:func:`oncely.testing.running_consumers` with short polls and batches of 200;
    ``settings`` are more :class:`~oncely.settings.ConsumerSettings` fields."""
    values = {"batch_size": 200, "poll_timeout_seconds": 0.2, "lanes": lanes, **settings}
    return testing.running_consumers(
        effects,
        names,
        engine,
        KafkaSettings(bootstrap_servers=bootstrap),
        ConsumerSettings(**values),  # type: ignore[arg-type]
        tracing=tracing,
    )


def scalar(engine: sa.Engine, sql: str, **params: object) -> object:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar_one()


class SlotReader:
    """A logical replication client on a thread that confirms what it is sent, as a connector.

    It streams ``slot`` (``pgoutput``, ``publication``) over a replication connection, so the
    slot is active, and every ``interval`` seconds asks the walsender for its position (a
    standby status update requesting a reply) and confirms it as flushed, as Debezium does once
    its offsets are flushed. A small WAL message written each round keeps the WAL moving, as
    traffic would. Clear ``confirming`` to model a connector that reads but does not confirm.
    """

    def __init__(self, dsn: str, slot: str, publication: str, *, interval: float = 0.1) -> None:
        self.dsn, self.slot, self.publication, self.interval = dsn, slot, publication, interval
        self.confirming = threading.Event()
        self.confirming.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slot-reader-{slot}", daemon=True)
        self._replication: psycopg.Connection[Any] | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> SlotReader:
        self._replication = psycopg.connect(self.dsn, replication="database", autocommit=True)
        self._replication.pgconn.send_query(
            f"START_REPLICATION SLOT {self.slot} LOGICAL 0/0 (proto_version '1', "
            f"publication_names '{self.publication}')".encode()
        )
        started = self._replication.pgconn.get_result()
        if started is None or started.status != psycopg.pq.ExecStatus.COPY_BOTH:
            message = started.error_message.decode() if started is not None else "no result"
            self._replication.close()
            raise RuntimeError(f"START_REPLICATION failed: {message}")
        self._thread.start()
        wait_until(lambda: self._active(), timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._replication is not None:
            self._replication.close()
        if self.error is not None:
            raise self.error

    def _active(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", [self.slot]
            ).fetchone()
        return bool(row and row[0])

    def _run(self) -> None:
        assert self._replication is not None
        pgconn = self._replication.pgconn
        sent = 0
        try:
            with psycopg.connect(self.dsn, autocommit=True) as traffic:
                while not self._stop.is_set():
                    traffic.execute("SELECT pg_logical_emit_message(false, 'oncely-test', '')")
                    pgconn.consume_input()
                    while True:
                        size, data = pgconn.get_copy_data(1)
                        if size <= 0:
                            break
                        # A keepalive ("k") carries the walsender's position, a change ("w")
                        # its own: both start with the position, 8 bytes after the tag.
                        if data[:1] in (b"k", b"w"):
                            sent = max(sent, struct.unpack(">Q", data[1:9])[0])
                    flushed = sent if self.confirming.is_set() else 0
                    micros = int((time.time() - 946_684_800) * 1_000_000)
                    pgconn.put_copy_data(
                        b"r" + struct.pack(">QQQqB", sent, flushed, flushed, micros, 1)
                    )
                    pgconn.flush()
                    time.sleep(self.interval)
        except BaseException as exc:  # reported by __exit__
            self.error = exc


def http_get(port: int, path: str) -> tuple[int, str]:
    """The status and body of ``GET http://127.0.0.1:<port><path>``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def metric(port: int, name: str) -> float:
    """The sum of the samples on ``port``'s ``/metrics`` whose line starts with ``name``."""
    _, text = http_get(port, "/metrics")
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    return sum(values)


@dataclass(frozen=True)
class CliResult:
    """What ``oncely ...`` printed and its exit status."""

    exit_code: int
    stdout: str
    stderr: str
    output: str
    """stdout and stderr interleaved, as a terminal shows them."""


def oncely_cli(*argv: str, env: dict[str, str] | None = None) -> CliResult:
    """Run ``oncely ARGV`` in this process, through the command line's error boundary (as
    ``main()`` does), with ``env`` added to the environment."""
    from typer.testing import CliRunner

    from oncely.cli import app
    from oncely.cli._errors import run

    with CliRunner().isolation(env=env) as (stdout, stderr, output):
        code = run(app, list(argv))
        sys.stdout.flush()
        sys.stderr.flush()
        return CliResult(
            code, stdout.getvalue().decode(), stderr.getvalue().decode(), output.getvalue().decode()
        )


_CATALOG = {
    # Column order, not ordinal_position: a migration's dropped columns leave gaps in attnum.
    "columns": """
        SELECT table_name, column_name,
               row_number() OVER (PARTITION BY table_name ORDER BY ordinal_position),
               data_type, is_nullable, column_default, is_identity, identity_generation,
               is_generated, generation_expression
        FROM information_schema.columns WHERE table_schema = 'public'
        ORDER BY table_name, ordinal_position""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
        ORDER BY 1, 2""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE NOT tgisinternal ORDER BY 1, 2""",
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
    # The shards are created with the schema, both ways.
    "shards": """
        SELECT 'oncely_relay_shards', shard, reading, after_seq, owner, epoch, lease_until
        FROM oncely_relay_shards ORDER BY shard""",
}


def schema_catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Columns, constraints, indexes, triggers, functions and shards of the ``public`` schema
    (``oncely_migrations`` left out), as PostgreSQL prints them back: two databases built two
    ways compare equal part by part."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        snapshot = {
            name: [
                tuple(row)
                for row in conn.execute(sa.text(sql))
                if "oncely_migrations" not in str(row[0])
            ]
            for name, sql in _CATALOG.items()
        }
    engine.dispose()
    return snapshot
