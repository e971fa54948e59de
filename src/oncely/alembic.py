"""Alembic support: keep oncely's tables out of autogenerate, apply oncely's migrations in yours.

Needs ``pip install 'oncely[alembic]'``. In ``env.py``, pass both filters to
``context.configure``: ``include_name`` keeps Alembic from reflecting oncely's tables at all,
``include_object`` also drops them from your ``target_metadata`` if it holds them::

    import oncely.alembic

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=oncely.alembic.include_name,
        include_object=oncely.alembic.include_object,
    )

In a revision, :func:`upgrade_oncely` applies oncely's packaged migrations up to a pinned
version in the revision's transaction, recording them in ``oncely_migrations`` as
``oncely db upgrade`` does (the two can be mixed); :func:`downgrade_oncely` drops them::

    from oncely.alembic import downgrade_oncely, upgrade_oncely

    def upgrade() -> None:
        upgrade_oncely(op, version=6)

    def downgrade() -> None:
        downgrade_oncely(op)

When a newer oncely ships migration 7, a new revision calls ``upgrade_oncely(op, version=7)``
(oncely's migrations are forward-only: leave its ``downgrade()`` empty).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import sqlalchemy as sa

from oncely.errors import ConfigurationError
from oncely.storage.migrations import Migration, drop_connection, upgrade_connection

if TYPE_CHECKING:
    from alembic.runtime.environment import NameFilterParentNames, NameFilterType
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy.sql.schema import SchemaItem

#: The names of oncely's tables, at every version, start with this (and no other's should).
TABLE_PREFIX = "oncely_"


class Op(Protocol):
    """What oncely needs of Alembic's ``op`` (the module in a revision, or an ``Operations``)."""

    def get_bind(self) -> sa.Connection: ...

    def get_context(self) -> MigrationContext: ...


def include_name(
    name: str | None, type_: NameFilterType, parent_names: NameFilterParentNames
) -> bool:
    """Alembic's ``include_name`` hook: false for oncely's tables and what belongs to them.

    Autogenerate (and ``alembic check``) then neither reflects nor compares them. Combine it
    with a filter of yours by ``and``.
    """
    if type_ == "schema":
        return True
    table = name if type_ == "table" else parent_names.get("table_name")
    return not (table or "").startswith(TABLE_PREFIX)


def include_object(
    object: SchemaItem,
    name: str | None,
    type_: NameFilterType,
    reflected: bool,
    compare_to: SchemaItem | None,
) -> bool:
    """Alembic's ``include_object`` hook: false for oncely's tables, their columns, indexes
    and constraints, whether reflected from the database or found in ``target_metadata``.

    Combine it with a filter of yours by ``and``.
    """
    if type_ == "table":
        table = name
    else:  # a column, index or constraint: each knows its table
        owner = getattr(object, "table", None)
        table = owner.name if isinstance(owner, sa.Table) else None
    return not (table or "").startswith(TABLE_PREFIX)


def upgrade_oncely(
    op: Op, *, version: int, schema: str | None = None, shards: int | None = None
) -> list[Migration]:
    """Apply oncely's migrations up to ``version`` that the database lacks, in the revision's
    transaction; return those applied (empty: the database already has them).

    Each is recorded in ``oncely_migrations`` under ``oncely db upgrade``'s lock, so running
    ``oncely db upgrade`` later applies only newer ones. ``schema`` and ``shards`` mean what
    they mean to ``oncely db upgrade`` (``--schema``, ``--shards``).

    Raises :class:`~oncely.errors.ConfigurationError` for a version this oncely does not
    ship, an invalid schema name or shard count, or Alembic's offline mode (``--sql``: which
    migrations the database lacks is only known online; ``oncely db sql`` prints them all);
    :class:`~oncely.storage.migrations.UpgradeRefusedError` when a migration refuses the
    database's state. Alembic then rolls the revision back.
    """
    return upgrade_connection(_bind(op), schema=schema, shards=shards, to_version=version)


def downgrade_oncely(op: Op, *, schema: str | None = None) -> None:
    """Drop oncely's tables (with their data), trigger functions and ``oncely_migrations``,
    in the revision's transaction, whichever version they are at.

    Nothing is dropped with ``CASCADE``: an object of yours that depends on oncely's tables
    makes it fail (and Alembic roll back). Raises
    :class:`~oncely.errors.ConfigurationError` for an invalid schema name or offline mode.
    """
    drop_connection(_bind(op), schema=schema)


def _bind(op: Op) -> sa.Connection:
    if op.get_context().as_sql:
        raise ConfigurationError(
            "oncely.alembic needs a database connection: in offline mode (alembic --sql) it "
            "cannot tell which oncely migrations the database lacks; run it online, or apply "
            "`oncely db sql` yourself"
        )
    return op.get_bind()
