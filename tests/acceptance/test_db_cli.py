"""`oncely db upgrade` and `oncely db sql` in subprocesses."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from oncely.storage import migrations

pytestmark = pytest.mark.acceptance


def _oncely(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oncely", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_db_upgrade_twice_is_a_no_op(new_database: Callable[..., str]) -> None:
    url = new_database(empty=True)
    first = _oncely("db", "upgrade", "--database-url", url)
    assert first.returncode == 0, first.stderr
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in migrations())
    assert f"applied {len(migrations())} migration(s): {names}" in first.stdout
    second = _oncely("db", "upgrade", "--database-url", url)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout


def test_db_upgrade_refuses_an_unsafe_schema_name(new_database: Callable[..., str]) -> None:
    result = _oncely(
        "db", "upgrade", "--database-url", new_database(empty=True), "--schema", 'x"; DROP'
    )
    assert result.returncode == 2
    assert "not a plain identifier" in result.stderr


def test_db_sql_prints_the_ddl() -> None:
    result = _oncely("db", "sql")
    assert result.returncode == 0
    for table in ("oncely_outbox", "oncely_receipts", "oncely_tasks", "oncely_idempotency_keys"):
        assert f"CREATE TABLE {table}" in result.stdout
    assert "CONSTRAINT oncely_receipts_pkey PRIMARY KEY (event_id, effect)" in result.stdout
