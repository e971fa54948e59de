"""oncely.alembic without a database: the autogenerate filters, the drop script's coverage,
offline mode."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations

from oncely.alembic import (
    TABLE_PREFIX,
    downgrade_oncely,
    include_name,
    include_object,
    upgrade_oncely,
)
from oncely.errors import ConfigurationError
from oncely.storage import partitions
from oncely.storage.migrations import drop_sql, migrations, validate_version
from oncely.storage.tables import build_metadata

USERS = sa.MetaData()
orders = sa.Table(
    "orders",
    USERS,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("email", sa.Text),
    sa.Column("outbox_id", sa.Uuid, sa.ForeignKey("oncely_outbox.id", name="orders_outbox_fkey")),
    sa.UniqueConstraint("email", name="orders_email_key"),
    sa.CheckConstraint("email <> ''", name="orders_email_check"),
    sa.Index("orders_email_idx", "email"),
)


def _parts(table: sa.Table) -> list[tuple[sa.schema.SchemaItem, str | None, str]]:
    """Every object of ``table`` as Alembic hands it to ``include_object``."""
    parts: list[tuple[sa.schema.SchemaItem, str | None, str]] = [(table, table.name, "table")]
    parts += [(column, column.name, "column") for column in table.columns]
    parts += [(index, index.name, "index") for index in table.indexes]
    for constraint in table.constraints:
        kind = {
            sa.UniqueConstraint: "unique_constraint",
            sa.ForeignKeyConstraint: "foreign_key_constraint",
            sa.CheckConstraint: "check_constraint",
        }.get(type(constraint))
        if kind is not None:
            parts.append((constraint, str(constraint.name), kind))
    return parts


@pytest.mark.parametrize("schema", [None, "events"])
def test_include_object_is_false_for_everything_of_oncely_s_tables(schema: str | None) -> None:
    tables = build_metadata(schema).tables.values()
    parts = [part for table in tables for part in _parts(table)]
    assert {kind for _, _, kind in parts} == {
        "table",
        "column",
        "index",
        "unique_constraint",
        "foreign_key_constraint",
        "check_constraint",
    }
    for item, name, kind in parts:
        for reflected in (True, False):
            assert not include_object(item, name, kind, reflected, None), (kind, name)


def test_include_object_is_true_for_the_user_s_objects_even_when_they_refer_to_oncely() -> None:
    parts = _parts(orders)
    assert len(parts) == 8
    for item, name, kind in parts:
        assert include_object(item, name, kind, False, None), (kind, name)


def test_include_name_is_false_for_oncely_s_tables_and_what_they_hold() -> None:
    assert include_name("public", "schema", {})
    assert include_name("events", "schema", {})
    assert not include_name("oncely_outbox", "table", {"schema_name": None})
    assert not include_name("oncely_migrations", "table", {"schema_name": "events"})
    for kind in ("column", "index", "unique_constraint", "foreign_key_constraint"):
        assert not include_name("x", kind, {"table_name": "oncely_tasks"})
        assert include_name("oncely_x", kind, {"table_name": "orders"})
    assert include_name("orders", "table", {"schema_name": None})


def test_every_oncely_table_starts_with_the_prefix() -> None:
    names = {table.name for table in build_metadata().tables.values()} | {"oncely_migrations"}
    assert {"oncely_outbox", "oncely_receipts", "oncely_tasks", "oncely_migrations"} <= names
    assert all(name.startswith(TABLE_PREFIX) for name in names)


def test_the_drop_script_names_every_table_and_function_any_migration_creates() -> None:
    created = set()
    for migration in migrations():
        found = re.findall(r"CREATE (?:OR REPLACE )?(?:TABLE|FUNCTION) (\w+)", migration.sql)
        created |= set(found)
    created |= set(build_metadata().tables) | {"oncely_migrations"}
    # What the conversion to the partitioned layout (oncely.storage.partitions) adds.
    created |= {
        partitions.LAYOUT_TABLE,
        partitions.KEYS_TABLE,
        "oncely_outbox_key_guard",
        "oncely_outbox_keys_forget",
    }
    assert {"oncely_outbox", "oncely_outbox_notify", "oncely_outbox_wake"} <= created
    dropped = set(re.findall(r"\b(oncely_\w+)\b[,;(]", drop_sql()))
    assert created == dropped


def test_a_version_this_oncely_does_not_ship_is_refused() -> None:
    latest = migrations()[-1].version
    assert validate_version(latest) == latest
    for version in (0, latest + 1):
        with pytest.raises(ConfigurationError, match=f"version {version}: this oncely ships"):
            validate_version(version)


def test_offline_mode_is_refused_with_the_way_out() -> None:
    op = Operations(MigrationContext.configure(dialect_name="postgresql", opts={"as_sql": True}))
    with pytest.raises(ConfigurationError, match=r"offline mode \(alembic --sql\).*oncely db sql"):
        upgrade_oncely(op, version=1)
    with pytest.raises(ConfigurationError, match="offline mode"):
        downgrade_oncely(op)
