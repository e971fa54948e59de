"""Batch writes, async handlers and the fetch loop against the real broker and database."""

from __future__ import annotations

import asyncio
import enum
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import NewTopic
from sqlalchemy.orm import Session

from oncely.consumers.effects import AsyncEffectContext, EffectContext
from oncely.consumers.runner import EffectConsumer
from oncely.consumers.writes import Writes
from oncely.schemas.codec import Codec
from tests.apps.ledger import App, create_tables, ledger
from tests.helpers import StatementSpy, publish_events, running_consumers, scalar, wait_until

pytestmark = pytest.mark.integration

balances = sa.Table(
    "balances",
    sa.MetaData(),
    sa.Column("account_id", sa.Text, primary_key=True),
    sa.Column("first_n", sa.Integer),
    sa.Column("last_n", sa.Integer),
)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE IF EXISTS balances"))
        balances.create(conn)
    yield engine
    engine.dispose()


def _applied(consumer: EffectConsumer) -> float:
    sample = consumer.metrics.registry.get_sample_value
    return sample("oncely_consumer_applied_total", {"effect": consumer.effect.name}) or 0.0


def _credits(app: App, count: int, accounts: int) -> list[tuple[uuid.UUID, Any]]:
    return [
        (uuid.uuid4(), app.model(account_id=f"acc-{n % accounts}", amount=n, n=n))
        for n in range(count)
    ]


def test_batch_writes_are_one_statement_per_batch_and_upserts_merge_in_order(
    app: App, engine: sa.Engine, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def post(event: Any, ctx: EffectContext) -> None:
        ctx.insert(ledger, {"event_id": ctx.event_id, "effect": ctx.effect, "n": event.n})
        # The first n of an account stays; the last one wins.
        values = {"account_id": event.account_id, "first_n": event.n, "last_n": event.n}
        ctx.upsert(balances, values, on=["account_id"], update=["last_n"])

    app.effects.effect("posted", on=[app.model])(post)
    events = _credits(app, 300, accounts=5)
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    spied = StatementSpy(monkeypatch)
    with running_consumers(app.effects, ["posted"], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _applied(consumer) == 300, timeout=60)
    statements = [s for s in spied if s.startswith("INSERT INTO ledger")]
    assert scalar(engine, "SELECT count(DISTINCT event_id) FROM ledger") == 300
    assert scalar(engine, "SELECT count(*) FROM ledger") == 300
    # Batches of up to 200 records (the helper's batch size): a writer per record would run 300.
    assert 1 <= len(statements) <= 12, len(statements)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(balances).order_by(balances.c.account_id)).all()
    by_partition: dict[str, list[int]] = {}
    for _, event in events:
        by_partition.setdefault(event.account_id, []).append(event.n)
    assert [(r.account_id, r.first_n, r.last_n) for r in rows] == [
        (account, ns[0], ns[-1]) for account, ns in sorted(by_partition.items())
    ]


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


typed = sa.Table(
    "typed_writes",
    sa.MetaData(),
    sa.Column("id", sa.Uuid),
    sa.Column("name", sa.Text),
    sa.Column("small", sa.SmallInteger),
    sa.Column("big", sa.BigInteger),
    sa.Column("price", sa.Numeric(12, 2)),
    sa.Column("flag", sa.Boolean),
    sa.Column("at", sa.DateTime(timezone=True)),
    sa.Column("day", sa.Date),
    sa.Column("doc", sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")),
    sa.Column("colour", sa.Enum(Colour, name="colour")),
    sa.Column("blob", sa.LargeBinary),
)


def test_batch_writes_store_every_common_column_type_as_sqlalchemy_would(
    engine: sa.Engine,
) -> None:
    """Arrays sent in binary (or as text where psycopg cannot) store the same values as
    SQLAlchemy's own INSERT of the same rows."""
    with engine.begin() as conn:
        typed.drop(conn, checkfirst=True)
        sa.Enum(Colour, name="colour").drop(conn, checkfirst=True)
        typed.create(conn)
    at = datetime(2026, 12, 4, 5, 6, 7, 890123, tzinfo=UTC)
    rows: list[dict[str, Any]] = [
        {
            "id": uuid.uuid4(),
            "name": 'a "quoted", {braced} \\ name',
            "small": 7,
            "big": 2**40,
            "price": Decimal("12.34"),
            "flag": True,
            "at": at,
            "day": date(2026, 12, 4),
            "doc": {"k": [1, "two", None]},
            "colour": Colour.RED,
            "blob": b"\x00\xff",
        },
        {
            "id": uuid.uuid4(),
            "name": None,
            "small": None,
            "big": -1,
            "price": Decimal("0.10"),
            "flag": False,
            "at": None,
            "day": None,
            "doc": None,
            "colour": Colour.BLUE,
            "blob": None,
        },
    ]
    writes = Writes()
    for row in rows:
        writes.insert(typed, row)
    with Session(engine) as session, session.begin():
        writes.write(session)
        ours = session.execute(sa.select(typed).order_by(typed.c.big.desc())).all()
        session.rollback()
    with Session(engine) as session, session.begin():
        session.execute(sa.insert(typed), rows)
        theirs = session.execute(sa.select(typed).order_by(typed.c.big.desc())).all()
        session.rollback()
    assert ours == theirs
    assert ours[0].at == at and ours[0].doc == {"k": [1, "two", None]}


def test_an_unknown_column_fails_the_record_with_a_clear_error(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    def post(event: Any, ctx: EffectContext) -> None:
        ctx.insert(ledger, {"event_id": ctx.event_id, "amount_cents": event.amount})

    app.effects.effect("typo", on=[app.model])(post)
    publish_events(kafka_bootstrap, Codec(registry=app.registry), _credits(app, 1, accounts=1))
    with running_consumers(app.effects, ["typo"], engine, kafka_bootstrap) as [consumer]:
        sample = consumer.metrics.registry.get_sample_value
        wait_until(
            lambda: (
                (sample("oncely_consumer_handler_failures_total", {"effect": "typo"}) or 0) >= 1
            ),
            timeout=60,
        )
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = 'typo'") == 0


class _Hooks(BaseHTTPRequestHandler):
    received: list[str] = []

    def do_POST(self) -> None:
        self.received.append(self.path)
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def hooks() -> Iterator[tuple[str, int, list[str]]]:
    received: list[str] = []
    handler = type("Hooks", (_Hooks,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", server.server_address[1], received
    finally:
        server.shutdown()
        server.server_close()


async def _post_hook(host: str, port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    await writer.wait_closed()
    return status


def test_an_async_handler_awaits_its_database_write_and_an_http_call_beside_a_sync_one(
    app: App, engine: sa.Engine, kafka_bootstrap: str, hooks: tuple[str, int, list[str]]
) -> None:
    host, port, received = hooks

    async def notify(event: Any, ctx: AsyncEffectContext) -> None:
        assert await _post_hook(host, port, f"/credited/{ctx.event_id}") == 204
        n = (await ctx.session.execute(sa.text("SELECT CAST(:n AS int)"), {"n": event.n})).scalar()
        await ctx.session.execute(
            sa.insert(ledger).values(event_id=ctx.event_id, effect=ctx.effect, n=n)
        )

    app.effects.effect("hooked", on=[app.model])(notify)
    events = _credits(app, 40, accounts=4)
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    effects = ["hooked", "ledger"]
    with running_consumers(app.effects, effects, engine, kafka_bootstrap, lanes=2) as consumers:
        for consumer in consumers:
            wait_until(lambda c=consumer: _applied(c) == 40, timeout=60)
    assert sorted(received) == sorted(f"/credited/{event_id}" for event_id, _ in events)
    for effect in effects:
        count = "SELECT count(DISTINCT event_id) FROM ledger WHERE effect = :e"
        assert scalar(engine, count, e=effect) == 40
        assert scalar(engine, "SELECT count(*) FROM ledger WHERE effect = :e", e=effect) == 40


#: Long enough to tell a record applied on arrival (well under a second) from one applied
#: after it: the second and third events are published as a poll begins, so a loop that waited
#: its poll out would apply them a full poll later. The test's end waits out the consumer's
#: last poll (up to this long).
POLL_TIMEOUT = 8.0


def test_a_record_is_applied_when_it_arrives_not_after_the_poll_timeout(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    codec = Codec(registry=app.registry)
    with running_consumers(
        app.effects, ["ledger"], engine, kafka_bootstrap, poll_timeout_seconds=POLL_TIMEOUT
    ) as [consumer]:
        wait_until(lambda: consumer.membership.joined_once, timeout=60)
        for i, event in enumerate(_credits(app, 3, accounts=1)):
            published = time.monotonic()
            publish_events(kafka_bootstrap, codec, [event])
            wait_until(lambda i=i: _applied(consumer) == i + 1, timeout=25, interval=0.01)
            assert time.monotonic() - published < POLL_TIMEOUT / 2, (
                f"applied long before the {POLL_TIMEOUT:g} s poll timeout"
            )


def test_the_installed_client_s_fetch_calls_behave_as_the_loop_relies_on(
    kafka_bootstrap: str, kafka_admin: Any
) -> None:
    """Pins confluent-kafka's ``poll``/``consume`` timing (``consume`` changed in 2.13)."""
    topic = f"pin-{uuid.uuid4().hex[:10]}"
    kafka_admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(30)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        consumer.subscribe([topic])
        assert consumer.consume(num_messages=10, timeout=0) == [], "nothing there: no wait"
        producer.produce(topic, b"first")
        producer.flush(30)
        started = time.monotonic()
        first = consumer.poll(20)
        assert first is not None and first.value() == b"first"
        assert time.monotonic() - started < 15, "poll returns the first record when it arrives"
        for i in range(5):
            producer.produce(topic, b"%d" % i)
        producer.flush(30)
        buffered: list[Any] = []
        deadline = time.monotonic() + 20
        while len(buffered) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
            buffered += consumer.consume(num_messages=10, timeout=0)
        assert [m.value() for m in buffered] == [b"%d" % i for i in range(5)], (
            "consume(n, 0) returns what is buffered without waiting"
        )
        producer.produce(topic, b"late")
        producer.flush(30)
        started = time.monotonic()
        batch = consumer.consume(num_messages=500, timeout=3)
        # A partial batch waits out the whole timeout (2.13 changed how consume() batches): the
        # reason the loop never gives consume() a timeout, and waits with poll() instead.
        assert [m.value() for m in batch] == [b"late"]
        assert time.monotonic() - started >= 2.5, "consume() returned a partial batch early"
    finally:
        consumer.close()
