"""``oncely demo``: what this build can do, shown end to end against real services.

At this stage of the project the pipeline (outbox, relay, consumers) is not built yet, so the
demo proves the ground it will stand on and says so: it brings up Kafka and PostgreSQL (or uses
``ONCELY_KAFKA_BOOTSTRAP_SERVERS`` and ``ONCELY_DATABASE_URL``), commits and rolls back one
PostgreSQL transaction each, produces one keyed record with headers through an idempotent
producer (``acks=all``), and consumes it back.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import typer
from confluent_kafka import Consumer, KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from rich.table import Table
from sqlalchemy.engine import make_url

from oncely.cli._output import err, out
from oncely.devstack import DevStack
from oncely.errors import DevstackError, OncelyError


@dataclass(frozen=True)
class _Services:
    kafka_bootstrap: str
    database_url: str
    origin: str


@contextlib.contextmanager
def _services() -> Iterator[_Services]:
    kafka = os.environ.get("ONCELY_KAFKA_BOOTSTRAP_SERVERS")
    database = os.environ.get("ONCELY_DATABASE_URL")
    if kafka and database:
        yield _Services(kafka, database, "ONCELY_* environment")
        return
    err.print("starting a local Kafka broker and PostgreSQL (oncely devstack) ...")
    with DevStack() as info:
        yield _Services(
            info.kafka_bootstrap,
            info.database_url,
            f"devstack: Kafka {info.kafka_version}, PostgreSQL {info.postgres_version}",
        )


def _libpq_dsn(sqlalchemy_url: str) -> str:
    return (
        make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)
    )


def _postgres_round_trip(dsn: str) -> tuple[str, int]:
    """Commit one row and roll back another in a scratch table; return (version, rows kept)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE demo_rows (note text NOT NULL)")
        with conn.transaction():
            conn.execute("INSERT INTO demo_rows VALUES ('committed')")
        with contextlib.suppress(_Rollback), conn.transaction():
            conn.execute("INSERT INTO demo_rows VALUES ('rolled back')")
            raise _Rollback
        version = conn.execute("SHOW server_version").fetchone()
        kept = conn.execute("SELECT count(*) FROM demo_rows").fetchone()
    return (str(version[0]) if version else "?", int(kept[0]) if kept else -1)


class _Rollback(Exception):
    pass


def _kafka_round_trip(bootstrap: str) -> tuple[Message, Message]:
    """Produce one record and consume it back; return (delivery report, consumed record)."""
    topic = f"oncely-demo-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(30)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
        }
    )
    reports: list[tuple[KafkaError | None, Message]] = []
    producer.produce(
        topic,
        key=b"transfer-1",
        value=b'{"hello": "oncely"}',
        headers=[("id", str(uuid.uuid4()).encode()), ("eventType", b"demo.hello")],
        on_delivery=lambda error, msg: reports.append((error, msg)),
    )
    if producer.flush(30) or not reports:
        raise OncelyError("the demo record was not delivered within 30 s")
    error, delivered = reports[0]
    if error is not None:
        raise OncelyError(f"the broker refused the demo record: {error}")
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.subscribe([topic])
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                return delivered, msg
        raise OncelyError(f"the demo record was not consumed back from {topic} within 60 s")
    finally:
        consumer.close()
        admin.delete_topics([topic])


def run() -> None:
    """Bring up Kafka and PostgreSQL and show one record produced and consumed (see docs)."""
    try:
        with _services() as services:
            pg_version, kept = _postgres_round_trip(_libpq_dsn(services.database_url))
            delivered, consumed = _kafka_round_trip(services.kafka_bootstrap)
    except (DevstackError, OncelyError, psycopg.Error) as exc:
        err.print(f"[red]demo failed:[/] {exc}")
        raise typer.Exit(1) from None
    table = Table(title="oncely demo — what this build did", show_lines=False)
    table.add_column("step")
    table.add_column("result")
    table.add_row("services", services.origin)
    table.add_row(
        "PostgreSQL", f"{pg_version}: 1 transaction committed, 1 rolled back -> {kept} row kept"
    )
    table.add_row(
        "produced",
        f"{delivered.topic()} partition {delivered.partition()} offset {delivered.offset()} "
        "(idempotent producer, acks=all, delivery report received)",
    )
    raw_headers = consumed.headers() or []
    pairs = raw_headers.items() if isinstance(raw_headers, dict) else raw_headers
    headers = ", ".join(f"{name}={value!r}" for name, value in pairs)
    table.add_row(
        "consumed",
        f"key={(consumed.key() or b'').decode()} value={(consumed.value() or b'').decode()} "
        f"headers: {headers}",
    )
    out.print(table)
    out.print(
        "Not built yet: the outbox, relay and consumers. This demo only proves the real broker "
        "and database they will run on."
    )
