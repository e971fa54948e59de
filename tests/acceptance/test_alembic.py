"""oncely in a user's Alembic project: the real ``alembic`` command in subprocesses.

Revisions that call ``oncely.alembic.upgrade_oncely`` build the same oncely objects as
``oncely db upgrade``, record the same versions (so ``oncely db upgrade`` afterwards applies
nothing), pin the version they apply, and ``downgrade_oncely`` removes them; the env.py filters
keep ``alembic check`` quiet about oncely's tables, which it reports without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from oncely.storage import migrations
from tests.helpers import run_captured, schema_catalog

pytestmark = pytest.mark.acceptance

BIN = Path(sys.executable).parent
LATEST = migrations()[-1].version

ALEMBIC_INI = """\
[alembic]
script_location = migrations
prepend_sys_path = .
path_separator = os
"""

MODELS = """\
import sqlalchemy as sa

metadata = sa.MetaData()

accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("email", sa.Text, nullable=False),
)
"""

ENV = """\
import os

import sqlalchemy as sa
from alembic import context

import oncely.alembic
from myapp.models import metadata

engine = sa.create_engine(os.environ["ONCELY_DATABASE_URL"])
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        include_name=oncely.alembic.include_name,
        include_object=oncely.alembic.include_object,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

FIRST = f"""\
import sqlalchemy as sa
from alembic import op

from oncely.alembic import downgrade_oncely, upgrade_oncely

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("email", sa.Text, nullable=False),
    )
    upgrade_oncely(op, version={LATEST - 1})


def downgrade() -> None:
    downgrade_oncely(op)
    op.drop_table("accounts")
"""

# What a user writes when a newer oncely ships a migration: a revision that pins it.
SECOND = f"""\
from alembic import op

from oncely.alembic import upgrade_oncely

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    upgrade_oncely(op, version={LATEST})


def downgrade() -> None:
    pass  # oncely's migrations are forward-only; 0001's downgrade drops its tables
"""

#: Rows of the catalog that are the user's, not oncely's.
USERS = {"accounts", "alembic_version", "accounts_id_seq"}


def _project(root: Path) -> None:
    files = {
        "alembic.ini": ALEMBIC_INI,
        "myapp/__init__.py": "",
        "myapp/models.py": MODELS,
        "migrations/env.py": ENV,
        "migrations/versions/0001_accounts_and_oncely.py": FIRST,
        "migrations/versions/0002_oncely_latest.py": SECOND,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _run(root: Path, url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ONCELY_DATABASE_URL": url, "PYTHONDONTWRITEBYTECODE": "1"}
    return run_captured([str(BIN / argv[0]), *argv[1:]], cwd=root, env=env, timeout=120)


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args}:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def _rows(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [tuple(row) for row in conn.execute(sa.text(sql))]
    engine.dispose()
    return rows


_VERSIONS = "SELECT version, name FROM oncely_migrations ORDER BY version"
_ONCELY_OBJECTS = """
    SELECT 'relation', relname FROM pg_class WHERE relname LIKE 'oncely%'
    UNION ALL SELECT 'function', proname FROM pg_proc WHERE proname LIKE 'oncely%'
    UNION ALL SELECT 'trigger', tgname FROM pg_trigger WHERE tgname LIKE 'oncely%'"""


def test_alembic_revisions_build_oncely_s_schema_and_check_stays_quiet(
    tmp_path: Path, new_database: Callable[..., str]
) -> None:
    _project(tmp_path)
    url, reference = new_database(empty=True), new_database(empty=True)

    # The first revision pins the version before the latest: the later one stays unapplied.
    _ok(_run(tmp_path, url, "alembic", "upgrade", "0001"))
    assert [v for v, _ in _rows(url, _VERSIONS)] == list(range(1, LATEST))
    _ok(_run(tmp_path, url, "alembic", "upgrade", "head"))
    checked = _ok(_run(tmp_path, url, "alembic", "check"))
    assert "No new upgrade operations detected" in checked
    assert "Did not recognize type" not in checked  # oncely's tables were not even reflected

    # The same objects and versions as `oncely db upgrade` on an empty database.
    _ok(_run(tmp_path, reference, "oncely", "db", "upgrade"))
    expected = schema_catalog(reference)
    built = {
        part: [row for row in rows if row[0] not in USERS]
        for part, rows in schema_catalog(url).items()
    }
    assert {row[1] for row in built["triggers"]} == {
        "oncely_outbox_wake",
        "oncely_relay_kept_forget",
        "oncely_tasks_notify",
    }
    assert len(built["indexes"]) > 10
    for part in expected:
        assert built[part] == expected[part], part
    assert _rows(url, _VERSIONS) == _rows(reference, _VERSIONS)
    assert "up to date" in _ok(_run(tmp_path, url, "oncely", "db", "upgrade"))

    # Without the filters, autogenerate proposes to drop oncely's tables: they are what matter.
    env = tmp_path / "migrations" / "env.py"
    env.write_text("\n".join(line for line in ENV.splitlines() if "include_" not in line) + "\n")
    unfiltered = _run(tmp_path, url, "alembic", "check")
    assert unfiltered.returncode != 0
    assert "New upgrade operations detected" in unfiltered.stderr + unfiltered.stdout
    assert "remove_table" in unfiltered.stderr + unfiltered.stdout
    assert "oncely_outbox" in unfiltered.stderr + unfiltered.stdout
    env.write_text(ENV)

    _ok(_run(tmp_path, url, "alembic", "downgrade", "base"))
    assert _rows(url, _ONCELY_OBJECTS) == []
    assert _rows(url, "SELECT to_regclass('accounts')") == [(None,)]
