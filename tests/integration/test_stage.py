"""stage(): the outbox row commits with the business rows or not at all (real PostgreSQL)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import javaproperties
import pytest
import sqlalchemy as sa
from examples.payments.events import TransferCompleted, registry
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from oncely.producer.staging import stage, stage_many
from oncely.schemas.codec import Codec
from oncely.storage import DuplicateEventError
from oncely.storage.tables import DEFAULT_SHARDS, NOTIFY_CHANNEL, shard_of
from oncely.storage.transactional import DuplicateInTransactionError
from tests.helpers import scalar

pytestmark = pytest.mark.integration

CODEC = Codec(registry=registry)


def _event(transfer_id: uuid.UUID | None = None) -> TransferCompleted:
    return TransferCompleted(
        transfer_id=transfer_id or uuid.uuid4(),
        amount=Decimal("12.50"),
        currency="EUR",
        from_account="acc-1",
        to_account="acc-2",
        completed_at=datetime(2026, 11, 29, 9, 0, tzinfo=UTC),
    )


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE transfers (id uuid PRIMARY KEY, note text)"))
    yield engine
    engine.dispose()


def _outbox(engine: sa.Engine) -> list[sa.Row[tuple[object, ...]]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM oncely_outbox ORDER BY seq")))


def _business(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM transfers"))


def test_session_commit_keeps_the_row_with_the_codec_bytes(engine: sa.Engine) -> None:
    event = _event()
    with Session(engine) as session, session.begin():
        session.execute(
            sa.text("INSERT INTO transfers VALUES (:id, 'x')"), {"id": event.transfer_id}
        )
        staged = stage(session, event, headers={"x-origin": "test"})
        txid = scalar(session.connection(), "SELECT pg_current_xact_id()::text")
    [row] = _outbox(engine)
    assert row.id == staged.id
    assert staged.id.version == 7
    assert row.type == "transfer.completed"
    assert row.topic == registry.get("transfer.completed").topic
    assert (row.aggregatetype, row.aggregateid) == ("transfer", str(event.transfer_id))
    assert row.event_key == str(staged.id)
    assert bytes(row.payload) == staged.payload
    assert CODEC.decode(bytes(row.payload), row.headers) == event
    assert row.headers["x-origin"] == "test"
    assert row.headers["content-type"] == "application/vnd.oncely.avro"
    # Written once: the relay reads it by the writing transaction and the key's shard.
    assert str(row.txid) == txid
    assert row.shard == shard_of(row.topic, row.aggregateid, DEFAULT_SHARDS)


def test_session_rollback_leaves_no_trace(engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.begin()
        session.execute(sa.text("INSERT INTO transfers VALUES (:id, 'x')"), {"id": uuid.uuid4()})
        stage(session, _event())
        session.flush()
        session.rollback()
    assert _outbox(engine) == []
    assert _business(engine) == 0


def test_connection_commit_and_rollback(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        with conn.begin():
            stage(conn, _event())
        transaction = conn.begin()
        stage(conn, _event())
        transaction.rollback()
    assert len(_outbox(engine)) == 1


def test_async_session_commit_and_rollback(database_url: str, engine: sa.Engine) -> None:
    async def run() -> None:
        async_engine = create_async_engine(database_url)
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                stage(session, _event(), idempotency_key="async-1")
            await session.begin()
            stage(session, _event(), idempotency_key="async-2")
            await session.flush()
            await session.rollback()
        await async_engine.dispose()

    asyncio.run(run())
    assert [row.event_key for row in _outbox(engine)] == ["async-1"]


def test_stage_many_writes_a_batch_in_order(engine: sa.Engine) -> None:
    events = [_event() for _ in range(5)]
    with Session(engine) as session, session.begin():
        staged = stage_many(session, events, idempotency_keys=[f"k{i}" for i in range(5)])
    rows = _outbox(engine)
    assert [row.event_key for row in rows] == [f"k{i}" for i in range(5)]
    assert [row.id for row in rows] == [s.id for s in staged]


def _count_insert_statements(engine: sa.Engine) -> None:
    """Count the INSERT statements on the outbox (a statement-level trigger of the test's own)."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE outbox_statements (n integer)"))
        conn.execute(
            sa.text(
                "CREATE FUNCTION count_outbox_statement() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN INSERT INTO outbox_statements VALUES (1); RETURN NULL; END $$"
            )
        )
        conn.execute(
            sa.text(
                "CREATE TRIGGER count_outbox_statement AFTER INSERT ON oncely_outbox"
                " FOR EACH STATEMENT EXECUTE FUNCTION count_outbox_statement()"
            )
        )


def _insert_statements(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox_statements"))


def test_stage_many_is_one_insert_statement(engine: sa.Engine) -> None:
    """A batch is one statement: the wake-up trigger fires once for it, not once per row."""
    _count_insert_statements(engine)
    with Session(engine) as session, session.begin():
        stage_many(session, [_event() for _ in range(7)])
    with engine.connect() as conn, conn.begin():
        stage_many(conn, [_event() for _ in range(3)], available_at=datetime.now(UTC))
    assert _insert_statements(engine) == 2
    assert len(_outbox(engine)) == 10


def test_savepoints_keep_or_drop_staged_rows(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        stage(session, _event(), idempotency_key="outer")
        with session.begin_nested() as savepoint:
            stage(session, _event(), idempotency_key="rolled-back")
            savepoint.rollback()
        with session.begin_nested():
            stage(session, _event(), idempotency_key="released")
    with engine.connect() as conn, conn.begin():
        savepoint = conn.begin_nested()
        stage(conn, _event(), idempotency_key="conn-rolled-back")
        savepoint.rollback()
        stage(conn, _event(), idempotency_key="conn-kept")
    keys = [row.event_key for row in _outbox(engine)]
    assert keys == ["outer", "released", "conn-kept"]


def test_other_database_errors_arrive_as_sqlalchemy_errors(engine: sa.Engine) -> None:
    """stage() writes on the DBAPI connection, and wraps its errors as SQLAlchemy would."""
    with Session(engine) as session, session.begin():
        with pytest.raises(sa.exc.DBAPIError):
            session.execute(sa.text("SELECT 1 / 0"))
        with pytest.raises(sa.exc.InternalError, match="InFailedSqlTransaction"):
            stage(session, _event())  # the transaction is aborted
        session.rollback()
    assert _outbox(engine) == []


def test_an_async_session_flush_reads_nothing_back(database_url: str, engine: sa.Engine) -> None:
    """The rows an AsyncSession flushes carry no RETURNING: nothing reads the defaults."""
    statements: list[str] = []

    async def run() -> None:
        async_engine = create_async_engine(database_url)
        sa.event.listen(
            async_engine.sync_engine,
            "before_cursor_execute",
            lambda conn, cursor, statement, *args: statements.append(statement),
        )
        async with AsyncSession(async_engine) as session, session.begin():
            stage_many(session, [_event(), _event()])
        await async_engine.dispose()

    asyncio.run(run())
    inserts = [s for s in statements if "INSERT INTO oncely_outbox" in s]
    assert inserts
    assert not [s for s in inserts if "RETURNING" in s.upper()]
    assert len(_outbox(engine)) == 2


def test_the_active_span_s_context_is_recorded_as_debezium_reads_it(engine: sa.Engine) -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("transfer") as span:
        with Session(engine) as session, session.begin():
            stage(session, _event())
            stage(session, _event(), headers={"x-tenant": "t1"})
        context = span.get_span_context()
    with Session(engine) as session, session.begin():
        stage(session, _event())  # no active span: no context
    traced, with_header, untraced = _outbox(engine)
    traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    # java.util.Properties text, the column Debezium's tracing SMT reads by default.
    assert traced.tracingspancontext == f"traceparent={traceparent}\n"
    assert javaproperties.loads(with_header.tracingspancontext) == {"traceparent": traceparent}
    assert "traceparent" not in traced.headers
    assert with_header.headers["x-tenant"] == "t1"
    assert untraced.tracingspancontext is None
    assert trace.get_current_span().get_span_context().is_valid is False


def test_the_same_event_key_twice_in_one_transaction_is_refused(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        stage(session, _event(), idempotency_key="once")
        with pytest.raises(DuplicateInTransactionError, match="'once'"):
            stage(session, _event(), idempotency_key="once")
        with pytest.raises(DuplicateInTransactionError, match="'twice'"):
            stage_many(session, [_event(), _event()], idempotency_keys=["twice", "twice"])
    assert [row.event_key for row in _outbox(engine)] == ["once"]


def test_duplicates_are_caught_when_the_transaction_began_implicitly(engine: sa.Engine) -> None:
    with Session(engine) as session:
        stage(session, _event(), idempotency_key="autobegun")
        with pytest.raises(DuplicateInTransactionError):
            stage(session, _event(), idempotency_key="autobegun")
        session.commit()
        stage(session, _event(), idempotency_key="next-transaction")
        session.commit()
    with engine.connect() as conn:
        stage(conn, _event(), idempotency_key="conn-autobegun")
        with pytest.raises(DuplicateInTransactionError):
            stage(conn, _event(), idempotency_key="conn-autobegun")
        conn.commit()
    keys = [row.event_key for row in _outbox(engine)]
    assert keys == ["autobegun", "next-transaction", "conn-autobegun"]


def test_an_event_key_from_an_earlier_transaction_is_refused_naming_it(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        stage(session, _event(), idempotency_key="transfer-42-completed")
    with (
        pytest.raises(DuplicateEventError, match="transfer-42-completed"),
        Session(engine) as session,
        session.begin(),
    ):
        stage(session, _event(), idempotency_key="transfer-42-completed")
    assert len(_outbox(engine)) == 1


def _member(engine: sa.Engine, relay_id: str, *, asleep: bool) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_members (relay_id, heartbeat_until, asleep)"
                " VALUES (:relay_id, now() + interval '1 minute', :asleep)"
                " ON CONFLICT (relay_id) DO UPDATE SET asleep = EXCLUDED.asleep"
            ),
            {"relay_id": relay_id, "asleep": asleep},
        )


def test_staging_notifies_only_while_a_relay_is_asleep(
    engine: sa.Engine, database_url: str
) -> None:
    """No NOTIFY (and its commit-time lock) while relays are awake; one while one sleeps."""
    import psycopg

    from oncely.testing.services import libpq_dsn

    def notifications() -> list[str]:
        with psycopg.connect(libpq_dsn(database_url), autocommit=True) as listener:
            listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            with Session(engine) as session, session.begin():
                stage(session, _event())
                stage(session, _event())
            return [note.channel for note in listener.notifies(timeout=1.5)]

    assert notifications() == []  # no relay at all
    _member(engine, "relay-a", asleep=False)
    assert notifications() == []  # a relay polling: it needs no wake-up
    _member(engine, "relay-b", asleep=True)
    assert notifications() == [NOTIFY_CHANNEL]  # one: a transaction's identical NOTIFYs fold
    _member(engine, "relay-b", asleep=False)
    assert notifications() == []
