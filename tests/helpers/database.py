"""PostgreSQL seen from a test: one statement run, one value, row or all rows of a query, the
statements sent, a replication client, the schema as PostgreSQL prints it back."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from tests.helpers.probes import wait_until

#: Where a query runs: a connection given (within its transaction), a connection of its own
#: from an engine, or from a throwaway engine on a database URL.
Bind = sa.Engine | sa.Connection | str


@contextlib.contextmanager
def _connection(bind: Bind, *, commit: bool = False) -> Iterator[sa.Connection]:
    if isinstance(bind, sa.Connection):
        yield bind
        return
    engine = sa.create_engine(bind) if isinstance(bind, str) else bind
    try:
        with engine.begin() if commit else engine.connect() as conn:
            yield conn
    finally:
        if isinstance(bind, str):
            engine.dispose()


def execute(bind: Bind, sql: str, **params: object) -> None:
    """Run the statement ``sql`` and commit it (on a connection given: within its transaction)."""
    with _connection(bind, commit=True) as conn:
        conn.execute(sa.text(sql), params)


def scalar(bind: Bind, sql: str, **params: object) -> Any:
    """The one value ``sql`` returns (one row, one column: else an error)."""
    with _connection(bind) as conn:
        return conn.execute(sa.text(sql), params).scalar_one()


def query_one(bind: Bind, sql: str, **params: object) -> sa.Row[Any]:
    """The one row ``sql`` returns (else an error)."""
    with _connection(bind) as conn:
        return conn.execute(sa.text(sql), params).one()


def query_all(bind: Bind, sql: str, **params: object) -> Sequence[sa.Row[Any]]:
    """Every row ``sql`` returns."""
    with _connection(bind) as conn:
        return conn.execute(sa.text(sql), params).all()


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
