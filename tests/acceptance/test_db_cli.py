"""`oncely db upgrade` and `oncely db sql` in subprocesses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from oncely.storage import migrations, upgrade
from tests.helpers import oncely_process, scalar

pytestmark = pytest.mark.acceptance


def test_db_upgrade_twice_is_a_no_op(new_database: Callable[..., str]) -> None:
    url = new_database(empty=True)
    first = oncely_process("db", "upgrade", "--database-url", url)
    assert first.returncode == 0, first.stderr
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in migrations())
    assert f"applied {len(migrations())} migration(s): {names}" in first.stdout
    second = oncely_process("db", "upgrade", "--database-url", url)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout


def test_db_upgrade_refuses_an_unsafe_schema_name(new_database: Callable[..., str]) -> None:
    result = oncely_process(
        "db", "upgrade", "--database-url", new_database(empty=True), "--schema", 'x"; DROP'
    )
    assert result.returncode == 2
    assert "not a plain identifier" in result.stderr


def test_db_sql_prints_the_ddl() -> None:
    result = oncely_process("db", "sql")
    assert result.returncode == 0
    for table in ("oncely_outbox", "oncely_receipts", "oncely_tasks", "oncely_idempotency_keys"):
        assert f"CREATE TABLE {table}" in result.stdout
    assert "CONSTRAINT oncely_receipts_pkey PRIMARY KEY (event_id, effect)" in result.stdout


def test_db_upgrade_shards_fixes_the_shard_count(new_database: Callable[..., str]) -> None:
    url = new_database(empty=True)
    bad = oncely_process("db", "upgrade", "--database-url", url, "--shards", "0")
    assert bad.returncode == 2
    assert "--shards 0: choose between 1 and 1024 shards" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    result = oncely_process("db", "upgrade", "--database-url", url, "--shards", "8")
    assert result.returncode == 0, result.stderr
    engine = sa.create_engine(url)
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_shards") == 8
    engine.dispose()
    again = oncely_process("db", "upgrade", "--database-url", url, "--shards", "16")
    assert again.returncode == 2
    assert "this database has 8 shards" in again.stderr


def test_db_upgrade_refuses_while_old_relay_leases_are_live(
    new_database: Callable[..., str],
) -> None:
    url = new_database(empty=True)
    engine = sa.create_engine(url)
    upgrade(engine, to_version=2)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_outbox (id, aggregatetype, aggregateid, type, topic, payload,"
                " event_key, lease_owner, lease_until) VALUES (gen_random_uuid(), 'a', 'k', 't',"
                " 't', '\\x00', 'e', 'old-relay', now() + interval '1 minute')"
            )
        )
    result = oncely_process("db", "upgrade", "--database-url", url)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: oncely db upgrade: 1 outbox row(s) are leased by a running relay: stop every "
        "relay, wait for the leases to expire (ONCELY_RELAY_LEASE_SECONDS) and retry"
    ]
    assert scalar(engine, "SELECT max(version) FROM oncely_migrations") == 2
    engine.dispose()
