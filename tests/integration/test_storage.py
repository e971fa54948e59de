"""oncely's tables: migrations and MetaData agree, upgrade is idempotent, errors are translated."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import psycopg.errors
import pytest
import sqlalchemy as sa

from oncely.storage import (
    DuplicateEventError,
    metadata,
    migrations,
    outbox,
    translate_errors_of,
    upgrade,
)
from oncely.storage.tables import DEFAULT_SHARDS, NOTIFY_CHANNEL, build_metadata
from oncely.testing.services import libpq_dsn
from tests.helpers import outbox_row, scalar, schema_catalog

pytestmark = pytest.mark.integration


def test_migrations_and_metadata_build_the_same_database(
    new_database: Callable[..., str],
) -> None:
    from_migrations, from_metadata = new_database(empty=True), new_database(empty=True)
    engine = sa.create_engine(from_migrations)
    upgrade(engine)
    engine.dispose()
    engine = sa.create_engine(from_metadata)
    metadata.create_all(engine)
    engine.dispose()

    migrated, created = schema_catalog(from_migrations), schema_catalog(from_metadata)
    assert len(migrated["columns"]) > 40
    assert {row[1] for row in migrated["triggers"]} == {
        "oncely_outbox_wake",
        "oncely_relay_kept_forget",
        "oncely_tasks_notify",
    }
    assert {row[0] for row in migrated["functions"]} == {
        "oncely_outbox_wake",
        "oncely_passed",
        "oncely_relay_kept_forget",
        "oncely_tasks_notify",
    }
    assert [row[1] for row in migrated["shards"]] == list(range(DEFAULT_SHARDS))
    for part in migrated:
        assert migrated[part] == created[part], part


def test_upgrade_twice_is_a_no_op_and_concurrent_upgrades_serialise(
    new_database: Callable[..., str],
) -> None:
    engine = sa.create_engine(new_database(empty=True), pool_size=4)
    results: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(len(upgrade(engine)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == [0, 0, len(migrations())]
    assert upgrade(engine) == []
    with engine.connect() as conn:
        versions = conn.execute(sa.text("SELECT version FROM oncely_migrations")).scalars().all()
    assert versions == [m.version for m in migrations()]
    engine.dispose()


def _wakes_a_sleeping_relay(url: str, schema: str) -> None:
    """Inserting into ``schema``'s outbox notifies only while a relay there is asleep.

    The inserting connection's search_path does not include ``schema``: the wake trigger finds
    ``oncely_relay_members`` by its schema (migration 0006).
    """
    in_schema = build_metadata(schema).tables[f"{schema}.oncely_outbox"]
    engine = sa.create_engine(url)

    def notified() -> list[str]:
        with psycopg.connect(libpq_dsn(url), autocommit=True) as listener:
            listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            with engine.begin() as conn:
                conn.execute(
                    sa.insert(in_schema),
                    outbox_row("t"),
                )
            return [note.channel for note in listener.notifies(timeout=1.5)]

    assert notified() == []
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {schema}.oncely_relay_members (relay_id, heartbeat_until, asleep)"
                " VALUES ('sleeper', now() + interval '1 minute', true)"
            )
        )
    assert notified() == [NOTIFY_CHANNEL]
    assert scalar(engine, f"SELECT count(*) FROM {schema}.oncely_outbox") == 2
    assert scalar(engine, f"SELECT count(*) FROM {schema}.oncely_relay_shards") == DEFAULT_SHARDS
    assert scalar(engine, "SELECT to_regclass('public.oncely_outbox')") is None
    engine.dispose()


def test_upgrade_into_a_named_schema(new_database: Callable[..., str]) -> None:
    url = new_database(empty=True)
    engine = sa.create_engine(url)
    assert upgrade(engine, schema="events") == list(migrations())
    assert upgrade(engine, schema="events") == []
    engine.dispose()
    _wakes_a_sleeping_relay(url, "events")


def test_metadata_in_a_named_schema(new_database: Callable[..., str]) -> None:
    url = new_database(empty=True)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA events"))
    build_metadata("events").create_all(engine)
    engine.dispose()
    _wakes_a_sleeping_relay(url, "events")


def test_a_duplicate_event_key_is_translated_by_constraint_name(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    row = outbox_row(
        "transfers",
        "7",
        aggregatetype="transfer",
        type="transfer.completed",
        event_key="transfer-7-completed",
    )
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4()})
    # An engine oncely never wrote through is left alone.
    with pytest.raises(sa.exc.IntegrityError) as untouched, engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4()})
    assert not isinstance(untouched.value, DuplicateEventError)
    with engine.connect() as conn:
        translate_errors_of(conn)  # what stage() and enqueue_task() do
    with (
        pytest.raises(DuplicateEventError, match="transfer-7-completed") as info,
        engine.begin() as conn,
    ):
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4()})
    assert isinstance(info.value.__cause__, psycopg.errors.UniqueViolation)
    # Any other integrity error is left as it was: here a NOT NULL violation.
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4(), "event_key": None})
    engine.dispose()


def test_the_passed_rule_is_inlined_where_it_is_called(engine: sa.Engine) -> None:
    """``oncely_passed`` (migration 0007) is one SQL expression the planner inlines: the plan
    names the snapshot functions, not a call of ours per row."""
    with engine.connect() as conn:
        plan = "\n".join(
            conn.execute(
                sa.text(
                    "EXPLAIN (VERBOSE) SELECT count(*) FROM oncely_outbox AS o "
                    "JOIN oncely_relay_shards AS s ON s.shard = o.shard "
                    "WHERE oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)"
                )
            ).scalars()
        )
    assert "pg_visible_in_snapshot" in plan and "oncely_passed" not in plan, plan
