"""Debezium mode's database chores through the CLI: the slot, its drop, and the purge.

The purge's tests drive real logical replication slots: advanced by
``pg_replication_slot_advance`` (an inactive slot), or read by :class:`SlotReader`, a
replication client that confirms what it is sent (an active slot, as a running connector's).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import sqlalchemy as sa

from oncely import debezium
from oncely.storage import outbox
from oncely.testing.services import libpq_dsn
from tests.helpers import (
    CliResult,
    SlotReader,
    count_published,
    fast_settings,
    insert_rows,
    oncely_cli,
    outbox_rows,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_an_idle_slot_is_shown_then_dropped(database_url: str, engine: sa.Engine) -> None:
    slot = f"idle_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": slot}
        )
    url = ["--database-url", database_url, "--slot-name", slot]
    shown = oncely_cli("debezium", "slot", *url, "--json")
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.stdout)
    assert status["active"] is False
    assert status["plugin"] == "pgoutput"
    assert isinstance(status["retained_wal_bytes"], int)
    dropped = oncely_cli("debezium", "drop-slot", *url)
    assert dropped.exit_code == 0, dropped.output
    assert f"dropped slot {slot}" in dropped.stdout
    assert oncely_cli("debezium", "slot", *url).exit_code == 1
    again = oncely_cli("debezium", "drop-slot", *url)
    assert again.exit_code == 0
    assert f"no slot {slot}" in again.stdout


def test_a_slot_held_by_a_reader_is_not_dropped(database_url: str, engine: sa.Engine) -> None:
    slot = f"held_{uuid.uuid4().hex[:12]}"
    dsn = libpq_dsn(database_url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
    # A walsender holds the slot while a replication connection streams from it.
    replication = psycopg.connect(dsn, replication="database", autocommit=True)
    try:
        replication.pgconn.send_query(
            f"START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', "
            f"publication_names 'none')".encode()
        )
        result = oncely_cli(
            "debezium", "drop-slot", "--database-url", database_url, "--slot-name", slot,
            "--wait", "1",
        )  # fmt: skip
        assert result.exit_code == 1
        assert "still in use" in result.stderr
    finally:
        replication.close()
    runner_done = oncely_cli(
        "debezium", "drop-slot", "--database-url", database_url, "--slot-name", slot
    )
    assert runner_done.exit_code == 0, runner_done.output


@pytest.fixture
def slots(engine: sa.Engine) -> Iterator[Callable[[], str]]:
    """Create logical replication slots (pgoutput) for the test; all dropped afterwards."""
    created: list[str] = []

    def create() -> str:
        slot = f"purge_{uuid.uuid4().hex[:12]}"
        with engine.begin() as conn:
            conn.execute(
                sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": slot}
            )
        created.append(slot)
        return slot

    yield create
    for slot in created:
        debezium.drop_slot(engine, slot, timeout=10)


@pytest.fixture
def publication(engine: sa.Engine) -> str:
    name = f"pub_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE PUBLICATION {name} FOR TABLE oncely_outbox"))
    return name


def _old_rows(count: int, *, topic: str = "t", days: int = 2) -> list[dict[str, object]]:
    rows = outbox_rows(count, topics=[topic], keys=2)
    for row in rows:
        row["created_at"] = datetime.now(UTC) - timedelta(days=days)
    return rows


def _ids(engine: sa.Engine) -> set[object]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT id FROM oncely_outbox")).scalars())


def _advance(engine: sa.Engine, slot: str, lsn: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_replication_slot_advance(:s, CAST(:lsn AS pg_lsn))"),
            {"s": slot, "lsn": lsn},
        )


def _purge(database_url: str, *args: str) -> CliResult:
    return oncely_cli(
        "debezium", "purge", "--database-url", database_url, "--older-than", "1d", *args
    )


def test_purge_deletes_only_the_rows_the_slot_has_confirmed(
    engine: sa.Engine, slots: Callable[[], str]
) -> None:
    slot = slots()
    read = _old_rows(3)  # committed after the slot's position: unread until it advances
    insert_rows(engine, read)
    # A transaction still open at the mark: its row commits after the mark's WAL position.
    open_conn = engine.connect()
    open_tx = open_conn.begin()
    open_row = _old_rows(1)
    open_conn.execute(sa.insert(outbox), open_row)
    plan = debezium.purge_plan(engine, older_than_seconds=86400, slot_name=slot)
    open_tx.commit()
    open_conn.close()
    after_mark = _old_rows(2)
    insert_rows(engine, after_mark)
    fresh = outbox_rows(1, topics=["t"], keys=1)
    insert_rows(engine, fresh)
    assert plan.rows == 3
    assert [(t.topic, t.rows) for t in plan.topics] == [("t", 3)]
    assert plan.topics[0].oldest_id in {row["id"] for row in read}
    assert not plan.slot.passed
    assert plan.slot.behind_bytes > 0

    # The connector has read nothing yet (an inactive slot before the mark): refused.
    with pytest.raises(debezium.SlotBehindError, match="inactive"):
        debezium.wait_for_slot(engine, slot, plan.mark, timeout=0)
    assert len(_ids(engine)) == 7

    # The connector confirms exactly the mark's position: the rows committed before it go;
    # the rows committed after it (the open transaction's, the later ones) and young rows stay.
    _advance(engine, slot, plan.mark.lsn)
    confirmed = debezium.wait_for_slot(engine, slot, plan.mark, timeout=0)
    assert (confirmed.passed, confirmed.behind_bytes) == (True, 0)
    assert confirmed.confirmed_flush_lsn == plan.mark.lsn
    deleted = debezium.purge_marked(engine, plan.mark, older_than_seconds=86400, batch_size=2)
    assert deleted == 3
    assert _ids(engine) == {row["id"] for row in (*open_row, *after_mark, *fresh)}


def test_purge_is_a_dry_run_without_execute(
    database_url: str, engine: sa.Engine, slots: Callable[[], str]
) -> None:
    slot = slots()
    rows = _old_rows(3, topic="a") + _old_rows(2, topic="b")
    insert_rows(engine, rows)
    _advance(engine, slot, str(scalar(engine, "SELECT pg_current_wal_insert_lsn()::text")))
    result = _purge(database_url)
    assert result.exit_code == 0, result.output
    assert "would delete 5 outbox row(s) created more than 1d ago" in result.stdout
    assert "  a: 3 row(s), oldest " in result.stdout
    assert "  b: 2 row(s), oldest " in result.stdout
    assert f"slot {slot} is inactive" in result.stdout
    assert "dry run: nothing changed; run again with --execute" in result.stdout
    assert len(_ids(engine)) == 5


def test_purge_deletes_old_rows_whether_or_not_the_relay_published_them(
    database_url: str,
    engine: sa.Engine,
    slots: Callable[[], str],
    publication: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    slot = slots()
    topic = new_topic()
    insert_rows(engine, outbox_rows(3, topics=[topic], keys=2))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == 3, timeout=30)
    insert_rows(engine, outbox_rows(2, topics=[topic], keys=2))  # never published
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE oncely_outbox SET created_at = now() - interval '2 days'"))
    insert_rows(engine, outbox_rows(2, topics=[topic], keys=2))
    with SlotReader(libpq_dsn(database_url), slot, publication):
        result = _purge(database_url, "--execute", "--wait", "30")
    assert result.exit_code == 0, result.output
    assert "deleted 5 outbox row(s)" in result.stdout
    assert f"confirmed by slot {slot}" in result.stdout
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 2


def test_the_first_snapshot_reads_exactly_the_rows_the_relay_has_not_published(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """The connector's snapshot statement, run as Debezium runs it: unpublished and held rows,
    in seq order; not the rows the relay acknowledged, nor a dead row parking its key."""
    topic = new_topic()
    rows = outbox_rows(12, topics=[topic], keys=4)
    later = datetime.now(UTC) + timedelta(hours=1)
    delayed = {**outbox_rows(1, topics=[topic], keys=1)[0], "aggregateid": "later"}
    delayed["available_at"] = later
    behind_delayed = {**outbox_rows(1, topics=[topic], keys=1)[0], "aggregateid": "later"}
    behind_delayed["available_at"] = datetime.now(UTC)
    insert_rows(engine, rows)
    insert_rows(engine, [delayed, behind_delayed])
    # key-0's first row failed for good: it parks the key (as the relay's dead-lettering does).
    dead_row = rows[0]
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason,"
                " error) SELECT topic, aggregateid, shard, id, 'dead', 'too large'"
                " FROM oncely_outbox WHERE id = :id"
            ),
            {"id": dead_row["id"]},
        )
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        # 12 rows: key-0's 3 (one dead, two held) and 9 published; "later": parked and held.
        wait_until(lambda: count_published(engine) == 9, timeout=30)
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_relay_held") == 3, timeout=30
        )
    unpublished = outbox_rows(3, topics=[topic], keys=3)
    insert_rows(engine, unpublished)

    statement = debezium.snapshot_statement("public")
    with engine.connect() as conn:
        read = [row.id for row in conn.execute(sa.text(statement))]
        seqs = dict(conn.execute(sa.text("SELECT id, seq FROM oncely_outbox")).all())
    held = [row["id"] for row in rows if row["aggregateid"] == "key-0"][1:]
    expected = [*held, delayed["id"], behind_delayed["id"], *(row["id"] for row in unpublished)]
    assert read == sorted(expected, key=seqs.__getitem__)
    assert len(read) == 7


def _refused(result: CliResult, exit_code: int, reason: str) -> None:
    assert result.exit_code == exit_code, result.output
    assert reason in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_purge_refuses_without_a_slot(database_url: str, engine: sa.Engine) -> None:
    insert_rows(engine, _old_rows(2))
    _refused(_purge(database_url, "--execute"), 2, "no logical replication slot in database")
    _refused(
        _purge(database_url, "--execute", "--slot-name", "oncely_outbox"),
        2,
        "no logical replication slot 'oncely_outbox'",
    )
    _refused(_purge(database_url), 2, "no logical replication slot in database")
    assert len(_ids(engine)) == 2


def test_purge_refuses_to_guess_between_slots(
    database_url: str, engine: sa.Engine, slots: Callable[[], str]
) -> None:
    first, second = sorted([slots(), slots()])
    insert_rows(engine, _old_rows(2))
    for slot in (first, second):
        _advance(engine, slot, str(scalar(engine, "SELECT pg_current_wal_insert_lsn()::text")))
    _refused(
        _purge(database_url, "--execute"),
        2,
        f"has 2 logical replication slots ({first}, {second}): name the connector's",
    )
    assert len(_ids(engine)) == 2


def test_purge_refuses_an_inactive_slot_behind_the_rows(
    database_url: str, engine: sa.Engine, slots: Callable[[], str]
) -> None:
    slot = slots()  # the connector created its slot, then stopped before reading these
    insert_rows(engine, _old_rows(2))
    _refused(_purge(database_url, "--execute"), 1, f"replication slot '{slot}' is inactive")
    assert len(_ids(engine)) == 2


def test_purge_gives_up_when_an_active_slot_does_not_confirm_in_time(
    database_url: str, engine: sa.Engine, slots: Callable[[], str], publication: str
) -> None:
    slot = slots()
    insert_rows(engine, _old_rows(2))
    with SlotReader(libpq_dsn(database_url), slot, publication) as reader:
        reader.confirming.clear()  # reading, but its offsets are not flushed yet
        result = _purge(database_url, "--execute", "--wait", "1")
    _refused(result, 1, "after 1 s: the connector confirms a position when it flushes")
    assert len(_ids(engine)) == 2
