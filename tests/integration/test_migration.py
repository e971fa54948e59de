"""`oncely db upgrade` from the per-row relay schema (0001 + 0002) to the log reader (0003).

Rows pending at upgrade time are published exactly once by the new relay; rows already
published or skipped are not; a dead row parks its key with its pending followers held behind
it. The upgrade refuses while a relay of the earlier model holds row leases, and ``shards``
fixes the number of key shards.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from oncely.errors import ConfigurationError
from oncely.storage import migrations, upgrade
from oncely.storage.migrations import UpgradeRefusedError
from oncely.storage.stores.outbox import dead
from oncely.storage.tables import shard_of
from tests.helpers import (
    count_published,
    fast_settings,
    insert_rows,
    outbox_rows,
    query_all,
    read_topics,
    running_relay,
    wait_until,
)

pytestmark = pytest.mark.integration

_OLD_INSERT = sa.text(
    """
    INSERT INTO oncely_outbox (id, aggregatetype, aggregateid, type, topic, payload, event_key,
                               status, attempts, available_at, lease_owner, lease_until,
                               last_error, published_at, kafka_partition, kafka_offset)
    VALUES (:id, 'account', :key, 'test.event', :topic, :payload, :event_key, :status, :attempts,
            now() + make_interval(secs => :due_in), :lease_owner,
            now() + make_interval(secs => :lease_in), :last_error,
            CASE WHEN :published THEN now() END, :partition, :offset)
    """
)


@pytest.fixture
def old_engine(new_database: Callable[..., str]) -> Iterator[sa.Engine]:
    """A database with the schema before the log reader: migrations 0001 and 0002 only."""
    engine = sa.create_engine(new_database(empty=True), pool_size=5)
    applied = upgrade(engine, to_version=2)
    assert [m.version for m in applied] == [1, 2]
    yield engine
    engine.dispose()


def _old_row(
    conn: sa.Connection,
    topic: str,
    key: str,
    status: str,
    *,
    due_in: float = -1.0,
    lease_owner: str | None = None,
    lease_in: float | None = None,
    last_error: str | None = None,
) -> str:
    """Insert a row as the per-row relay left it; return its id."""
    event_id = str(uuid.uuid4())
    published = status == "published"
    conn.execute(
        _OLD_INSERT,
        {
            "id": event_id,
            "event_key": event_id,
            "key": key,
            "topic": topic,
            "payload": f"{key}:{status}:{event_id}".encode(),
            "status": status,
            "attempts": 3 if status == "dead" else 0,
            "due_in": due_in,
            "lease_owner": lease_owner,
            "lease_in": lease_in,
            "last_error": last_error,
            "published": published,
            "partition": 0 if published else None,
            "offset": 7 if published else None,
        },
    )
    return event_id


def _versions(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.text("SELECT version FROM oncely_migrations ORDER BY 1")).scalars()
        )


def test_upgrade_publishes_every_pending_row_once_and_parks_the_keys_of_dead_rows(
    old_engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    with old_engine.begin() as conn:
        published = [_old_row(conn, topic, f"done-{i}", "published") for i in range(5)]
        skipped = _old_row(conn, topic, "skipped-key", "skipped", last_error="skipped by op")
        after_skipped = _old_row(conn, topic, "skipped-key", "pending")
        pending = [_old_row(conn, topic, f"key-{i % 4}", "pending") for i in range(20)]
        # An old relay died holding this one: its lease has expired, so the upgrade may run.
        expired = _old_row(conn, topic, "key-0", "pending", lease_owner="old-relay", lease_in=-5)
        delayed = _old_row(conn, topic, "later", "pending", due_in=6.0)
        behind_delayed = _old_row(conn, topic, "later", "pending")
        dead_row = _old_row(conn, topic, "poison", "dead", last_error="MSG_SIZE_TOO_LARGE")
        behind_dead = [_old_row(conn, topic, "poison", "pending") for _ in range(2)]
        other = _old_row(conn, topic, "key-1", "pending")
    upgraded_at = time.monotonic()
    assert [m.version for m in upgrade(old_engine)] == [m.version for m in migrations()][2:]
    assert _versions(old_engine) == [m.version for m in migrations()]
    # Nothing is published yet, and the dead row is listed (with its followers held once read).
    assert count_published(old_engine) == len(published) + 1  # the skipped row counts as settled
    assert [row.id for row in dead.list_dead(old_engine)] == [uuid.UUID(dead_row)]

    due_now = [after_skipped, *pending, expired, other]
    with running_relay(old_engine, kafka_bootstrap, fast_settings()):
        wait_until(
            lambda: (
                {r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic])}
                >= set(due_now)
            ),
            timeout=60,
        )
        early = {r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic])}
        if time.monotonic() - upgraded_at < 5.0:
            assert delayed not in early and behind_delayed not in early
        wait_until(
            lambda: (
                behind_delayed
                in {r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic])}
            ),
            timeout=60,
        )
        wait_until(lambda: dead.list_dead(old_engine)[0].held == 2, timeout=30)
        time.sleep(1.0)  # a relay that would publish held rows has had the time to

    records = read_topics(kafka_bootstrap, [topic])
    copies = Counter(r.headers["id"].decode() for r in records)
    assert set(copies.values()) == {1}, "a row was published twice"
    assert set(copies) == {*due_now, delayed, behind_delayed}
    assert not set(copies) & {*published, skipped, dead_row, *behind_dead}
    by_key: dict[str, list[str]] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(record.key, []).append(record.headers["id"].decode())
    assert by_key["later"] == [delayed, behind_delayed]
    assert by_key["key-0"] == [
        pending[0],
        pending[4],
        pending[8],
        pending[12],
        pending[16],
        expired,
    ]

    [parked] = dead.list_dead(old_engine)
    assert (parked.id, parked.topic, parked.aggregateid, parked.held) == (
        uuid.UUID(dead_row),
        topic,
        "poison",
        2,
    )
    assert parked.error == "MSG_SIZE_TOO_LARGE"

    # Requeued, the dead row and then its followers are published, in order, once.
    assert [row.id for row in dead.requeue(old_engine)] == [uuid.UUID(dead_row)]
    with running_relay(old_engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: not dead.list_dead(old_engine), timeout=60)
    poison = [
        r.headers["id"].decode()
        for r in sorted(read_topics(kafka_bootstrap, [topic]), key=lambda r: r.offset)
        if r.key == "poison"
    ]
    assert poison == [dead_row, *behind_dead]


def test_upgrade_refuses_while_an_old_relay_holds_leases(old_engine: sa.Engine) -> None:
    with old_engine.begin() as conn:
        _old_row(conn, "t", "k", "pending", lease_owner="old-relay", lease_in=30)
        _old_row(conn, "t", "k2", "pending")
    with pytest.raises(UpgradeRefusedError) as info:
        upgrade(old_engine)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "oncely db upgrade: 1 outbox row(s) are leased by a running relay: stop every relay, "
        "wait for the leases to expire (ONCELY_RELAY_LEASE_SECONDS) and retry"
    )
    assert _versions(old_engine) == [1, 2]  # nothing of 0003 was applied
    with old_engine.begin() as conn:
        conn.execute(sa.text("UPDATE oncely_outbox SET lease_until = now() - interval '1 s'"))
    assert [m.version for m in upgrade(old_engine)] == [m.version for m in migrations()][2:]


def test_shards_fix_the_number_of_key_shards(
    new_database: Callable[..., str], kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    engine = sa.create_engine(new_database(empty=True))
    with pytest.raises(ConfigurationError, match=r"--shards 0: choose between 1 and 1024"):
        upgrade(engine, shards=0)
    with pytest.raises(ConfigurationError, match=r"--shards 1025: choose between 1 and 1024"):
        upgrade(engine, shards=1025)
    assert upgrade(engine, shards=8) == list(migrations())
    shards = query_all(engine, "SELECT shard FROM oncely_relay_shards ORDER BY 1")
    assert [shard for (shard,) in shards] == list(range(8))
    topics = [new_topic(partitions=2) for _ in range(2)]
    insert_rows(engine, outbox_rows(400, topics=topics, keys=50))
    rows = query_all(engine, "SELECT topic, aggregateid, shard FROM oncely_outbox")
    assert {row.shard for row in rows} == set(range(8))
    assert all(row.shard == shard_of(row.topic, row.aggregateid, 8) for row in rows)

    with running_relay(engine, kafka_bootstrap, fast_settings()) as relay:
        wait_until(lambda: count_published(engine) == 400, timeout=60)
        assert relay.shards == frozenset(range(8))
    assert len(read_topics(kafka_bootstrap, topics)) == 400

    # Later upgrades keep the count: naming another one is an error, the same one a no-op.
    with pytest.raises(ConfigurationError, match="this database has 8 shards"):
        upgrade(engine, shards=32)
    assert upgrade(engine, shards=8) == []
    engine.dispose()
