"""oncely.alembic in process, against real PostgreSQL: autogenerate with the filters, the
operations inside a revision's transaction (a named schema, every version dropped), bad input.

tests/acceptance/test_alembic.py runs the same through the ``alembic`` command.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations

from oncely.alembic import downgrade_oncely, include_name, include_object, upgrade_oncely
from oncely.errors import ConfigurationError
from oncely.storage import build_metadata, metadata, migrations, upgrade
from tests.helpers import scalar

pytestmark = pytest.mark.integration

LATEST = migrations()[-1].version
USERS = sa.MetaData()
sa.Table("accounts", USERS, sa.Column("id", sa.Integer, primary_key=True))

_ONCELY_OBJECTS = """
    SELECT 'relation', relname FROM pg_class WHERE relname LIKE 'oncely%'
    UNION ALL SELECT 'function', proname FROM pg_proc WHERE proname LIKE 'oncely%'
    UNION ALL SELECT 'trigger', tgname FROM pg_trigger WHERE tgname LIKE 'oncely%'"""


@pytest.fixture
def empty_engine(new_database: Callable[..., str]) -> Iterator[sa.Engine]:
    engine = sa.create_engine(new_database(empty=True))
    yield engine
    engine.dispose()


def _diff(engine: sa.Engine, target: list[sa.MetaData], **filters: object) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts=filters)
        return list(compare_metadata(context, target))


@pytest.mark.parametrize("with_oncely", [False, True], ids=["users", "users+oncely"])
def test_the_filters_leave_oncely_s_tables_out_of_autogenerate(
    engine: sa.Engine, with_oncely: bool
) -> None:
    USERS.create_all(engine)
    target = [USERS, metadata] if with_oncely else [USERS]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of oncely's is even reflected
        assert _diff(engine, target, include_name=include_name, include_object=include_object) == []
    # include_object alone hides them too, but reflects them first: SQLAlchemy then warns about
    # the types it does not know (xid8, pg_snapshot), an error under filterwarnings=error.
    with pytest.warns(sa.exc.SAWarning, match="Did not recognize type"):
        assert _diff(engine, target, include_object=include_object) == []
    if with_oncely:  # include_name alone: oncely's MetaData asks for tables it cannot see
        added = _diff(engine, target, include_name=include_name)
        assert {str(d[1].name) for d in added if d[0] == "add_table"} >= {"oncely_outbox"}
    else:  # no filter: autogenerate would drop oncely's tables
        with pytest.warns(sa.exc.SAWarning, match="Did not recognize type"):
            unfiltered = _diff(engine, target)
        removed = {str(d[1].name) for d in unfiltered if d[0] == "remove_table"}
        assert {"oncely_outbox", "oncely_migrations"} <= removed


def test_a_named_schema_leaves_the_revision_s_search_path_as_it_was(
    empty_engine: sa.Engine,
) -> None:
    with empty_engine.begin() as conn:
        op = Operations(MigrationContext.configure(conn))
        before = scalar(conn, "SHOW search_path")
        applied = upgrade_oncely(op, version=LATEST, schema="events", shards=8)
        assert [m.version for m in applied] == [m.version for m in migrations()]
        assert scalar(conn, "SHOW search_path") == before
        assert scalar(conn, "SELECT current_setting('oncely.shards', true)") in ("", None)
        # What the revision does next lands where it would have without oncely.
        op.create_table("accounts", sa.Column("id", sa.Integer, primary_key=True))
        assert scalar(conn, "SELECT to_regclass('public.accounts')") == "accounts"
        assert scalar(conn, "SELECT count(*) FROM events.oncely_relay_shards") == 8
        assert upgrade_oncely(op, version=LATEST, schema="events") == []
    assert upgrade(empty_engine, schema="events", shards=8) == []
    with empty_engine.begin() as conn:
        downgrade_oncely(Operations(MigrationContext.configure(conn)), schema="events")
        assert conn.execute(sa.text(_ONCELY_OBJECTS)).all() == []
        assert scalar(conn, "SELECT to_regclass('public.accounts')") == "accounts"


@pytest.mark.parametrize("version", range(1, LATEST + 1))
def test_downgrade_drops_what_any_version_created(empty_engine: sa.Engine, version: int) -> None:
    upgrade(empty_engine, to_version=version)
    with empty_engine.begin() as conn:
        assert conn.execute(sa.text(_ONCELY_OBJECTS)).all() != []
        downgrade_oncely(Operations(MigrationContext.configure(conn)))
        assert conn.execute(sa.text(_ONCELY_OBJECTS)).all() == []


def test_downgrade_drops_the_tables_created_from_the_metadata(empty_engine: sa.Engine) -> None:
    build_metadata().create_all(empty_engine)
    with empty_engine.begin() as conn:
        downgrade_oncely(Operations(MigrationContext.configure(conn)))
        assert conn.execute(sa.text(_ONCELY_OBJECTS)).all() == []


def test_downgrade_refuses_to_drop_what_the_user_s_objects_depend_on(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE VIEW recent AS SELECT id FROM oncely_outbox"))
    refused = pytest.raises(
        sa.exc.InternalError, match="view recent depends on table oncely_outbox"
    )
    with refused, engine.begin() as conn:
        downgrade_oncely(Operations(MigrationContext.configure(conn)))
    with engine.connect() as conn:
        assert scalar(conn, "SELECT to_regclass('oncely_outbox')") == "oncely_outbox"


def test_a_version_this_oncely_does_not_ship_is_refused_before_any_change(
    empty_engine: sa.Engine,
) -> None:
    with empty_engine.begin() as conn:
        op = Operations(MigrationContext.configure(conn))
        with pytest.raises(ConfigurationError, match=f"version {LATEST + 1}: this oncely ships"):
            upgrade_oncely(op, version=LATEST + 1)
        assert conn.execute(sa.text(_ONCELY_OBJECTS)).all() == []
