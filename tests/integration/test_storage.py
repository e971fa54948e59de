"""oncely's tables: migrations and MetaData agree, upgrade is idempotent, errors are translated."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg.errors
import pytest
import sqlalchemy as sa

from oncely.storage import DuplicateEventKeyError, metadata, migrations, outbox, upgrade
from oncely.storage.tables import build_metadata

pytestmark = pytest.mark.integration

_CATALOG = {
    "columns": """
        SELECT table_name, column_name, ordinal_position, data_type, is_nullable,
               column_default, is_identity, identity_generation
        FROM information_schema.columns WHERE table_schema = 'public'
        ORDER BY table_name, ordinal_position""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
        ORDER BY 1, 2""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE NOT tgisinternal ORDER BY 1, 2""",
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
}


def _catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        snapshot = {
            name: [
                tuple(row)
                for row in conn.execute(sa.text(sql))
                if "oncely_migrations" not in str(row[0])
            ]
            for name, sql in _CATALOG.items()
        }
    engine.dispose()
    return snapshot


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

    migrated, created = _catalog(from_migrations), _catalog(from_metadata)
    assert len(migrated["columns"]) > 40
    assert {row[1] for row in migrated["triggers"]} == {
        "oncely_outbox_notify",
        "oncely_tasks_notify",
    }
    for part in _CATALOG:
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


def test_upgrade_into_a_named_schema(new_database: Callable[..., str]) -> None:
    engine = sa.create_engine(new_database(empty=True))
    assert upgrade(engine, schema="events") == list(migrations())
    assert upgrade(engine, schema="events") == []
    in_schema = build_metadata("events").tables["events.oncely_outbox"]
    with engine.begin() as conn:
        conn.execute(
            sa.insert(in_schema),
            {
                "id": uuid.uuid4(),
                "aggregatetype": "a",
                "aggregateid": "1",
                "type": "t",
                "topic": "t",
                "payload": b"x",
                "event_key": "k",
            },
        )
        assert conn.execute(sa.text("SELECT count(*) FROM events.oncely_outbox")).scalar() == 1
        public = conn.execute(sa.text("SELECT to_regclass('public.oncely_outbox')")).scalar()
    assert public is None
    engine.dispose()


def test_a_duplicate_event_key_is_translated_by_constraint_name(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    row = {
        "aggregatetype": "transfer",
        "aggregateid": "7",
        "type": "transfer.completed",
        "topic": "transfers",
        "payload": b"{}",
        "event_key": "transfer-7-completed",
    }
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4()})
    with (
        pytest.raises(DuplicateEventKeyError, match="transfer-7-completed") as info,
        engine.begin() as conn,
    ):
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4()})
    assert isinstance(info.value.__cause__, psycopg.errors.UniqueViolation)
    # Any other integrity error is left as it was: here a NOT NULL violation.
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "id": uuid.uuid4(), "event_key": None})
    engine.dispose()
