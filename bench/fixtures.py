"""What the benchmark cells run on: a database with oncely's tables, topics, and staged rows."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg.types.json import Jsonb

from oncely.ops.metrics import RelayMetrics
from oncely.relay import build_relay
from oncely.settings import KafkaSettings, RelaySettings
from oncely.storage import outbox
from oncely.testing.services import libpq_dsn

PAYLOAD = b"x" * 200


@dataclass
class Bench:
    """The services and knobs of one benchmark run."""

    engine: sa.Engine
    database_url: str
    bootstrap: str
    rows: int
    keys: int
    batch_size: int
    partitions: int = 6

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap})

    def new_topic(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        admin = self.admin()
        admin.create_topics([NewTopic(name, num_partitions=self.partitions)])[name].result(30)
        return name

    def relay_settings(self) -> RelaySettings:
        return RelaySettings(
            batch_size=self.batch_size,
            max_in_flight=max(2000, 4 * self.batch_size),
            poll_interval_seconds=0.2,
            purge_interval_seconds=3600,
        )

    def relay_env(self) -> dict[str, str]:
        """The environment of an ``oncely relay run`` process with :meth:`relay_settings`."""
        settings = self.relay_settings()
        return {
            "ONCELY_DATABASE_URL": self.database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "ONCELY_RELAY_BATCH_SIZE": str(settings.batch_size),
            "ONCELY_RELAY_MAX_IN_FLIGHT": str(settings.max_in_flight),
            "ONCELY_RELAY_POLL_INTERVAL_SECONDS": str(settings.poll_interval_seconds),
            "ONCELY_RELAY_PURGE_INTERVAL_SECONDS": str(settings.purge_interval_seconds),
        }


def staged_rows(count: int, *, topic: str, keys: int) -> list[dict[str, object]]:
    """Rows as a producer stages them: ``count`` events over ``keys`` keys, 200-byte payloads."""
    return [
        {
            "id": uuid.uuid4(),
            "aggregatetype": "account",
            "aggregateid": f"key-{i % keys}",
            "type": "bench.event",
            "topic": topic,
            "payload": PAYLOAD,
            "headers": {"content-type": "application/octet-stream"},
            "event_key": f"bench-{uuid.uuid4().hex}",
        }
        for i in range(count)
    ]


def insert_fresh(conn: sa.Connection, rows: list[dict[str, object]]) -> None:
    """Insert ``rows`` into the outbox with fresh ids and event keys, 5,000 per statement."""
    for start in range(0, len(rows), 5000):
        chunk = [
            {**row, "id": uuid.uuid4(), "event_key": uuid.uuid4().hex}
            for row in rows[start : start + 5000]
        ]
        conn.execute(sa.insert(outbox), chunk)


def restage(bench: Bench, rows: list[dict[str, object]]) -> None:
    """Empty the outbox and stage ``rows`` again (fresh ids), then refresh the statistics."""
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_outbox"))
        insert_fresh(conn, rows)
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE oncely_outbox"))


def published(bench: Bench) -> int:
    with bench.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM oncely_outbox WHERE status = 'published'")
            ).scalar_one()
        )


@contextmanager
def relays(bench: Bench, count: int = 1) -> Iterator[list[object]]:
    """``count`` relays on threads for the duration of the block."""
    stop = threading.Event()
    running = [
        build_relay(
            engine=bench.engine,
            kafka=KafkaSettings(bootstrap_servers=bench.bootstrap),
            settings=bench.relay_settings(),
            stop=stop,
            metrics=RelayMetrics(),
        )
        for _ in range(count)
    ]
    threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in running]
    for thread in threads:
        thread.start()
    try:
        yield list(running)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def wait_published(bench: Bench, total: int, *, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while published(bench) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {published(bench)} of {total} rows published")
        time.sleep(0.1)


@dataclass
class Writes:
    """When each open-loop write was due and when its transaction had committed (wall clock)."""

    writers: list[Callable[[int, float], None]]
    due: list[float]
    committed: list[float] = field(default_factory=list)

    def achieved_rate(self) -> float:
        return len(self.due) / (max(self.committed) - self.due[0])


@contextmanager
def outbox_writers(bench: Bench, rows: list[dict[str, Any]], *, count: int) -> Iterator[Writes]:
    """``count`` writers for :func:`bench.harness.open_loop`: ``writer(i, due)`` commits
    ``rows[i]`` as a one-row transaction.

    Each writer has its own autocommit connection and one prepared INSERT (one round trip per
    transaction), so that the writers limit the offered load as little as Python can.
    """
    columns = list(rows[0])
    insert = (
        f"INSERT INTO oncely_outbox ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))})"
    )
    writes = Writes([], [0.0] * len(rows), [0.0] * len(rows))
    connections = [
        psycopg.connect(libpq_dsn(bench.database_url), autocommit=True) for _ in range(count)
    ]

    def writer(conn: psycopg.Connection[Any]) -> Callable[[int, float], None]:
        def write(i: int, due_at: float) -> None:
            writes.due[i] = due_at
            values = [Jsonb(v) if c == "headers" else v for c, v in rows[i].items()]
            conn.execute(insert, values, prepare=True)
            writes.committed[i] = time.time()

        return write

    writes.writers = [writer(conn) for conn in connections]
    try:
        yield writes
    finally:
        for conn in connections:
            conn.close()
