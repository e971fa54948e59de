"""Versioned, idempotent schema migrations: ``oncely db upgrade``.

Migrations are the packaged ``migrations/NNNN_name.sql`` files, applied in order, each recorded
in ``oncely_migrations``. The whole upgrade is one transaction holding an advisory lock, so
concurrent upgrades serialise and a failed one leaves nothing half-applied: the command's own
transaction (:func:`upgrade`) or an Alembic revision's (:func:`upgrade_connection`, through
:mod:`oncely.alembic`). ``migrations/drop.sql`` drops what any of them created.

Migration 0003 (the relay as a log reader) fixes the number of key shards (``shards``,
default 32) and refuses to run while relays of the earlier model hold row leases.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from importlib import resources

import psycopg.errors
import sqlalchemy as sa

from oncely.errors import ConfigurationError, OncelyError
from oncely.storage import partitions
from oncely.storage.tables import MAX_SHARDS, validate_schema_name

#: pg_advisory_xact_lock key of ``oncely db upgrade`` ("oncely" in ASCII).
_LOCK_KEY = 0x6F6E63656C79
_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


#: The version whose migration creates the shards (``oncely_relay_shards``).
SHARDS_VERSION = 3
#: Steps of partitions created ahead by the conversion (``oncely retention run`` keeps them).
AHEAD = 3
#: Messages a migration raises on purpose start with this (see 0003's lease check).
_REFUSAL = "oncely db upgrade: "


class UpgradeRefusedError(OncelyError):
    """The upgrade was refused: the database is not in a state it can migrate from now."""


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


def validate_shards(shards: int) -> int:
    """Return ``shards`` if it is a valid shard count (1-1024), else raise ConfigurationError."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ConfigurationError(
            f"--shards {shards}: choose between 1 and {MAX_SHARDS} shards (at most one relay "
            "reads a shard at a time, so more shards allow more relays)"
        )
    return shards


def upgrade(
    engine: sa.Engine,
    *,
    schema: str | None = None,
    shards: int | None = None,
    to_version: int | None = None,
    partition_every: timedelta | None = None,
) -> list[Migration]:
    """Apply the migrations ``engine``'s database lacks; return those applied (empty: no-op).

    One transaction: :func:`upgrade_connection` on a connection of ``engine``, then commit.
    Any error rolls the whole upgrade back.
    """
    with engine.begin() as conn:
        return upgrade_connection(
            conn,
            schema=schema,
            shards=shards,
            to_version=to_version,
            partition_every=partition_every,
        )


def upgrade_connection(
    conn: sa.Connection,
    *,
    schema: str | None = None,
    shards: int | None = None,
    to_version: int | None = None,
    partition_every: timedelta | None = None,
) -> list[Migration]:
    """Apply the migrations ``conn``'s database lacks, in ``conn``'s open transaction (the
    caller commits); return those applied (empty: no-op).

    Records each in ``oncely_migrations`` under an advisory lock held to the end of the
    transaction, so concurrent upgrades serialise. With ``schema``, the tables live in that
    schema (created if missing). ``shards`` is the number of key shards the relay reads by
    (default 32): it is fixed by the upgrade that applies migration 0003 and cannot change
    later; given to a later upgrade it must equal the database's count. ``to_version`` stops
    after that migration (an Alembic revision pins it; tests of older schemas). With
    ``partition_every``, the outbox and the receipts are then converted to tables partitioned
    by that step (:func:`oncely.storage.partitions.convert`: every row copied, both tables
    locked until commit), unless they already are. The transaction's ``search_path`` is as
    before when this returns.

    Raises :class:`~oncely.errors.ConfigurationError` for an invalid schema name, shard count
    (or one that differs from the database's) or version, :class:`UpgradeRefusedError` when a
    migration refuses the database's state (e.g. rows leased by a running relay of the earlier
    model); other database errors propagate, leaving the transaction to be rolled back.
    """
    if shards is not None:
        validate_shards(shards)
    if to_version is not None:
        validate_version(to_version)
    applied: list[Migration] = []
    with _scoped(conn, schema, {} if shards is None else {"oncely.shards": str(shards)}):
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS oncely_migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = set(conn.execute(sa.text("SELECT version FROM oncely_migrations")).scalars())
        if shards is not None and SHARDS_VERSION in done:
            existing = conn.execute(sa.text("SELECT count(*) FROM oncely_relay_shards")).scalar()
            if existing != shards:
                raise ConfigurationError(
                    f"--shards {shards}: this database has {existing} shards, fixed when "
                    "migration 0003 was applied; drop --shards (it cannot change later)"
                )
        for migration in migrations():
            if migration.version in done:
                continue
            if to_version is not None and migration.version > to_version:
                break
            try:
                conn.exec_driver_sql(migration.sql)
            except sa.exc.DBAPIError as exc:
                if isinstance(exc.orig, psycopg.errors.RaiseException) and str(
                    exc.orig.diag.message_primary or ""
                ).startswith(_REFUSAL):
                    raise UpgradeRefusedError(str(exc.orig.diag.message_primary)) from exc
                raise
            conn.execute(
                sa.text("INSERT INTO oncely_migrations (version, name) VALUES (:v, :n)"),
                {"v": migration.version, "n": migration.name},
            )
            applied.append(migration)
        if partition_every is not None:
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            partitions.convert(conn, step=partition_every, ahead=AHEAD, now=now)
    return applied


def drop_connection(conn: sa.Connection, *, schema: str | None = None) -> None:
    """Drop every table and trigger function any oncely migration creates, and
    ``oncely_migrations``, in ``conn``'s open transaction (the caller commits).

    Whatever version the database is at; objects already gone are skipped. The schema itself
    stays. Raises :class:`~oncely.errors.ConfigurationError` for an invalid schema name; a
    database error (e.g. an object of yours depends on one of oncely's tables: nothing is
    dropped with ``CASCADE``) propagates, leaving the transaction to be rolled back.
    """
    with _scoped(conn, schema, {}):
        conn.exec_driver_sql(drop_sql())


@cache
def drop_sql() -> str:
    """The packaged ``migrations/drop.sql``: what :func:`drop_connection` runs."""
    return resources.files(__package__).joinpath("migrations", "drop.sql").read_text()


def validate_version(version: int) -> int:
    """Return ``version`` if this oncely ships that migration, else raise ConfigurationError."""
    latest = migrations()[-1].version
    if not 1 <= version <= latest:
        raise ConfigurationError(
            f"oncely migration version {version}: this oncely ships versions 1 to {latest}; "
            "pin one of those, or install the oncely that ships it"
        )
    return version


@contextmanager
def _scoped(conn: sa.Connection, schema: str | None, settings: dict[str, str]) -> Iterator[None]:
    """Take the upgrade lock and, for the body, set ``search_path`` to ``schema`` (created if
    missing) and ``settings``, all local to the transaction; restore them after the body, so
    statements a caller runs next in the same transaction (an Alembic revision) are unaffected.
    """
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    if schema is not None:
        quoted = conn.dialect.identifier_preparer.quote_identifier(validate_schema_name(schema))
        conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        settings = {**settings, "search_path": quoted}
    before = {
        name: conn.execute(sa.text("SELECT current_setting(:name, true)"), {"name": name}).scalar()
        for name in settings
    }
    for name, value in settings.items():
        _set_local(conn, name, value)
    yield
    for name, previous in before.items():
        _set_local(conn, name, previous or "")


def _set_local(conn: sa.Connection, name: str, value: str) -> None:
    conn.execute(sa.text("SELECT set_config(:name, :value, true)"), {"name": name, "value": value})
