"""Debezium mode's database chores through the CLI: the slot, its drop, and the purge."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from oncely.cli.debezium import app
from oncely.testing.services import libpq_dsn
from tests.helpers import insert_rows, outbox_rows, scalar

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


def test_an_idle_slot_is_shown_then_dropped(database_url: str, engine: sa.Engine) -> None:
    slot = f"idle_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": slot}
        )
    runner = CliRunner()
    url = ["--database-url", database_url, "--slot-name", slot]
    shown = runner.invoke(app, ["slot", *url, "--json"])
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.stdout)
    assert status["active"] is False
    assert status["plugin"] == "pgoutput"
    assert isinstance(status["retained_wal_bytes"], int)
    dropped = runner.invoke(app, ["drop-slot", *url])
    assert dropped.exit_code == 0, dropped.output
    assert f"dropped slot {slot}" in dropped.stdout
    assert runner.invoke(app, ["slot", *url]).exit_code == 1
    again = runner.invoke(app, ["drop-slot", *url])
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
        result = CliRunner().invoke(
            app, ["drop-slot", "--database-url", database_url, "--slot-name", slot, "--wait", "1"]
        )
        assert result.exit_code == 1
        assert "still in use" in result.stderr
    finally:
        replication.close()
    runner_done = CliRunner().invoke(
        app, ["drop-slot", "--database-url", database_url, "--slot-name", slot]
    )
    assert runner_done.exit_code == 0, runner_done.output


def test_purge_deletes_old_rows_whatever_their_status(database_url: str, engine: sa.Engine) -> None:
    rows = outbox_rows(5, topics=["t"], keys=2)
    insert_rows(engine, rows)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE oncely_outbox SET created_at = now() - interval '2 days'"))
        conn.execute(sa.text("UPDATE oncely_outbox SET status = 'published' WHERE seq = 1"))
    insert_rows(engine, outbox_rows(2, topics=["t"], keys=2))
    result = CliRunner().invoke(
        app, ["purge", "--database-url", database_url, "--older-than", "1d"]
    )
    assert result.exit_code == 0, result.output
    assert "deleted 5 outbox row(s)" in result.stdout
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 2
