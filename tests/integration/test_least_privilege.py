"""`oncely db sql --roles` grants are enough, and no more: the pipeline runs under those roles.

The writer stages events (sync and async sessions), enqueues a task and claims an idempotency
key; the relay publishes; consumers apply a ledger effect and an effect that enqueues tasks.
The operator reads the status, verifies, republishes from the outbox, asks for a dead row to
be requeued and purges. Each role is then refused what it should not do.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from oncely.consumers.completeness import check_effects
from oncely.ops.republish import republish
from oncely.ops.status import collect_status
from oncely.ops.verify import verify_window
from oncely.producer.idempotency import IdempotencyKeys
from oncely.producer.staging import stage
from oncely.relay.publisher import Publisher
from oncely.settings import CompletenessSettings
from oncely.storage import partitions, upgrade
from oncely.storage.errors import DuplicateEventError
from oncely.storage.stores.outbox import dead
from oncely.storage.stores.outbox.relay import RelayStore
from oncely.tasks.enqueue import enqueue_task
from tests.apps.ledger import build, create_tables
from tests.helpers import (
    count_published,
    fast_settings,
    oncely_cli,
    running_consumers,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration

PASSWORD = "role-pw"


@pytest.fixture
def roles(database_url: str) -> Iterator[tuple[dict[str, str], Callable[[str], sa.Engine]]]:
    """Four fresh LOGIN roles with the printed GRANTs; an engine factory per role."""
    yield from _roles(database_url)


def _roles(database_url: str) -> Iterator[tuple[dict[str, str], Callable[[str], sa.Engine]]]:
    suffix = uuid.uuid4().hex[:8]
    names = {
        "writer": f"w_{suffix}",
        "relay": f"r_{suffix}",
        "consumer": f"c_{suffix}",
        "operator": f"o_{suffix}",
    }
    printed = oncely_cli(
        "db", "sql", "--roles", *(arg for k, v in names.items() for arg in (f"--{k}", v))
    )
    assert printed.exit_code == 0, printed.output
    owner = sa.create_engine(database_url)
    engines = [owner]
    with owner.begin() as conn:
        for role in names.values():
            conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
        conn.exec_driver_sql(printed.output)
        create_tables(owner)
        # The app's own tables, as the --roles output tells: the effect writes to the ledger.
        conn.exec_driver_sql(f"GRANT INSERT ON ledger TO {names['consumer']}")

    def engine_of(role: str) -> sa.Engine:
        engine = sa.create_engine(make_url(database_url).set(username=role, password=PASSWORD))
        engines.append(engine)
        return engine

    try:
        yield names, engine_of
    finally:
        for engine in engines[1:]:
            engine.dispose()
        with owner.begin() as conn:
            for role in names.values():
                conn.exec_driver_sql(f"DROP OWNED BY {role}")
                conn.exec_driver_sql(f"DROP ROLE {role}")
        owner.dispose()


def _refused(engine: sa.Engine, sql: str) -> bool:
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(sql)
    except sa.exc.ProgrammingError as exc:
        return "permission denied" in str(exc.orig)
    return False


@pytest.mark.timeout(180)
def test_pipeline_runs_under_the_printed_roles(
    roles: tuple[dict[str, str], Callable[[str], sa.Engine]],
    database_url: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
) -> None:
    names, engine_of = roles
    prefix = f"lp{uuid.uuid4().hex[:10]}."
    app = build(prefix, group_prefix=prefix)
    kafka_admin.create_topics([NewTopic(app.topic, num_partitions=2)])[app.topic].result(30)
    owner = sa.create_engine(database_url)

    writer = engine_of(names["writer"])
    with Session(writer) as session, session.begin():
        for n in range(6):
            stage(session, app.model(account_id=f"a{n % 3}", amount=n + 1, n=n))
        enqueue_task(session, "note", {"n": 1})

    async def stage_async() -> None:
        url = make_url(database_url).set(
            drivername="postgresql+psycopg", username=names["writer"], password=PASSWORD
        )
        engine = create_async_engine(url)
        try:
            async with AsyncSession(engine) as session, session.begin():
                stage(session, app.model(account_id="a9", amount=7, n=6))
        finally:
            await engine.dispose()

    asyncio.run(stage_async())
    keys = IdempotencyKeys(writer)
    assert keys.claim("api", "k-1").previous is None
    keys.finish("api", "k-1", "accepted", result={"ok": True})
    assert keys.claim("api", "k-1").duplicate

    with running_relay(engine_of(names["relay"]), kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(owner) == 7, timeout=60)
    assert scalar(owner, "SELECT count(*) FROM oncely_relay_shards WHERE owner IS NULL") == 32

    consumer = engine_of(names["consumer"])
    with running_consumers(app.effects, ["ledger", "email"], consumer, kafka_bootstrap):
        wait_until(lambda: scalar(owner, "SELECT count(*) FROM oncely_receipts") == 14, timeout=90)
    assert scalar(owner, "SELECT count(*) FROM ledger") == 7
    # Its effects' completeness, as the consumer process checks it, with its grants alone.
    with consumer.connect() as conn, conn.begin():
        checked = check_effects(
            conn,
            [app.effects.get("ledger")],
            CompletenessSettings(grace_seconds=0, bucket_seconds=1),
        )
    assert [(c.effect, c.missing) for c in checked] == [("ledger", 0)]
    assert scalar(owner, "SELECT count(*) FROM oncely_tasks WHERE name = 'email.send'") == 7

    # The operator reads status, verifies, republishes, asks for a requeue and purges.
    operator = engine_of(names["operator"])
    kafka = {"bootstrap.servers": kafka_bootstrap}
    since = datetime.now(UTC) - timedelta(hours=1)
    status = collect_status(operator, effects=app.effects, kafka_config=kafka)
    assert sum(t.unpublished for t in status.topics) == 0 and len(status.shards) == 32
    assert verify_window(operator, kafka_config=kafka, effects=[], since=since).ok
    publisher = Publisher(kafka, client=kafka)
    assert (
        republish(operator, publisher=publisher, since=since, until=None, event_type=None).rows == 7
    )
    first = scalar(owner, "SELECT id FROM oncely_outbox ORDER BY seq LIMIT 1")
    with owner.begin() as conn:  # a dead row, as the relay parks its key
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason) "
                "SELECT topic, aggregateid, shard, id, 'dead' FROM oncely_outbox WHERE id = :id"
            ),
            {"id": first},
        )
    assert [row.id for row in dead.list_dead(operator)] == [first]
    assert len(dead.requeue(operator, ids=[first])) == 1
    purger = RelayStore(operator, owner="purge")
    assert sum(t.rows for t in purger.purge_preview(older_than_seconds=0)) == 5
    assert purger.purge(older_than_seconds=0) == 5, "all but the parked key a0's two rows"

    refusals: dict[str, list[str]] = {
        "writer": [
            "UPDATE oncely_outbox SET type = 'x'",
            "SELECT done FROM oncely_relay_shards",
            "UPDATE oncely_relay_members SET asleep = true",
            "DELETE FROM oncely_outbox",
            "SELECT payload FROM oncely_outbox",
            "SELECT * FROM oncely_receipts",
        ],
        "relay": [
            "INSERT INTO oncely_outbox (id) VALUES (gen_random_uuid())",
            "UPDATE oncely_outbox SET type = 'x'",
            "SELECT * FROM oncely_receipts",
            "SELECT * FROM oncely_tasks",
            "SELECT * FROM oncely_idempotency_keys",
        ],
        "consumer": [
            # It counts outbox rows (its effects' completeness): never a payload, never a write.
            "SELECT payload FROM oncely_outbox",
            "SELECT headers FROM oncely_outbox",
            "UPDATE oncely_outbox SET type = 'x'",
            "DELETE FROM oncely_receipts",
            "UPDATE oncely_tasks SET status = 'dead'",
            "SELECT * FROM ledger",
        ],
        "operator": [
            "INSERT INTO oncely_outbox (id) VALUES (gen_random_uuid())",
            "UPDATE oncely_outbox SET type = 'x'",
            "UPDATE oncely_relay_shards SET owner = 'me'",
            "DELETE FROM oncely_relay_parked",
            "DELETE FROM oncely_relay_held",
            "UPDATE oncely_relay_members SET asleep = true",
        ],
    }
    allowed: list[Any] = [
        (role, sql)
        for role, sqls in refusals.items()
        for sql in sqls
        if not _refused(engine_of(names[role]), sql)
    ]
    owner.dispose()
    assert not allowed, f"allowed but should be refused: {allowed}"


@pytest.mark.timeout(180)
def test_roles_granted_before_the_partitioning_still_stage_relay_and_consume(
    new_database: Callable[..., str], kafka_bootstrap: str, kafka_admin: AdminClient
) -> None:
    """The GRANTs printed for an unpartitioned outbox, applied before `oncely db upgrade
    --partition-every`: the conversion carries them over, so the writer stages (its seq from
    the new sequence, its key checked across partitions), the relay publishes and the consumer
    applies, with no new GRANT."""
    database_url = new_database(empty=True)
    owner = sa.create_engine(database_url)
    upgrade(owner)
    with owner.connect() as conn:
        assert partitions.step_of(conn) is None
    prefix = f"lp{uuid.uuid4().hex[:10]}."
    app = build(prefix, group_prefix=prefix)
    kafka_admin.create_topics([NewTopic(app.topic, num_partitions=2)])[app.topic].result(30)
    granted = _roles(database_url)
    names, engine_of = next(granted)
    try:
        upgrade(owner, partition_every=timedelta(minutes=1))
        with owner.connect() as conn:
            assert partitions.step_of(conn) == timedelta(minutes=1)
        writer = engine_of(names["writer"])
        with Session(writer) as session, session.begin():
            for n in range(4):
                stage(session, app.model(account_id=f"a{n % 2}", amount=n + 1, n=n))
            stage(session, app.model(account_id="k", amount=1, n=9), idempotency_key="once")
        with pytest.raises(DuplicateEventError), Session(writer) as session, session.begin():
            stage(session, app.model(account_id="k", amount=1, n=9), idempotency_key="once")
        assert scalar(owner, "SELECT count(*) FROM oncely_outbox_default") == 0
        with running_relay(engine_of(names["relay"]), kafka_bootstrap, fast_settings()):
            wait_until(lambda: count_published(owner) == 5, timeout=60)
        consumer = engine_of(names["consumer"])
        with running_consumers(app.effects, ["ledger"], consumer, kafka_bootstrap):
            wait_until(
                lambda: scalar(owner, "SELECT count(*) FROM oncely_receipts") == 5, timeout=90
            )
        assert scalar(owner, "SELECT count(*) FROM ledger") == 5
        assert scalar(owner, "SELECT count(*) FROM oncely_receipts_default") == 0
    finally:
        granted.close()
        owner.dispose()
