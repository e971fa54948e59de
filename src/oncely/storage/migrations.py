"""Versioned, idempotent schema migrations: ``oncely db upgrade``.

Migrations are the packaged ``migrations/NNNN_name.sql`` files, applied in order, each recorded
in ``oncely_migrations``. The whole upgrade is one transaction holding an advisory lock, so
concurrent upgrades serialise and a failed one leaves nothing half-applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import sqlalchemy as sa

from oncely.storage.tables import validate_schema_name

#: pg_advisory_xact_lock key of ``oncely db upgrade`` ("oncely" in ASCII).
_LOCK_KEY = 0x6F6E63656C79
_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str = field(repr=False)


@cache
def migrations() -> tuple[Migration, ...]:
    """The packaged migrations, by version."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        match = _FILE_NAME.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text()))
    return tuple(sorted(found, key=lambda m: m.version))


def upgrade_sql() -> str:
    """Every migration's SQL, in order, for DBAs who apply DDL themselves."""
    return "\n".join(f"-- migration {m.version:04d}_{m.name}\n{m.sql}" for m in migrations())


def upgrade(engine: sa.Engine, *, schema: str | None = None) -> list[Migration]:
    """Apply the migrations ``engine``'s database lacks; return those applied (empty: no-op).

    With ``schema``, the tables live in that schema (created if missing). Raises
    :class:`~oncely.errors.ConfigurationError` for an invalid schema name; database errors
    propagate and roll the whole upgrade back.
    """
    applied: list[Migration] = []
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
        if schema is not None:
            quoted = conn.dialect.identifier_preparer.quote_identifier(validate_schema_name(schema))
            conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
            conn.exec_driver_sql(f"SET LOCAL search_path TO {quoted}")
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS oncely_migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = set(conn.execute(sa.text("SELECT version FROM oncely_migrations")).scalars())
        for migration in migrations():
            if migration.version in done:
                continue
            conn.exec_driver_sql(migration.sql)
            conn.execute(
                sa.text("INSERT INTO oncely_migrations (version, name) VALUES (:v, :n)"),
                {"v": migration.version, "n": migration.name},
            )
            applied.append(migration)
    return applied
