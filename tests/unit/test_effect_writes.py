"""How ``ctx.insert`` / ``ctx.upsert`` rows become statements (the SQL itself runs in the
integration tests against PostgreSQL)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from oncely import WriteError
from oncely.consumers.writes import Writes

metadata = sa.MetaData()
ledger = sa.Table(
    "ledger", metadata, sa.Column("event_id", sa.Uuid), sa.Column("amount", sa.Integer)
)
balances = sa.Table(
    "balances",
    metadata,
    sa.Column("account", sa.Text, primary_key=True),
    sa.Column("first", sa.Integer),
    sa.Column("last", sa.Integer),
)
tagged = sa.Table("tagged", metadata, sa.Column("tags", postgresql.ARRAY(sa.Text)))
defaulted = sa.Table(
    "defaulted",
    metadata,
    sa.Column("n", sa.Integer),
    sa.Column("kind", sa.Text, default="plain"),
)


class Base(DeclarativeBase):
    pass


class Note(Base):
    __tablename__ = "notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    body: Mapped[str]


def _write(writes: Writes) -> list[tuple[str, Any]]:
    """What :meth:`Writes.write` would execute on psycopg, as text; then forget the rows."""
    executed = writes.statements(psycopg_dialect(), psycopg.adapters)  # type: ignore[no-untyped-call]
    writes.clear()
    return [(str(statement), params) for statement, params in executed]


def test_rows_of_one_table_are_one_statement_with_an_array_per_column() -> None:
    writes = Writes()
    ids = [uuid.uuid4() for _ in range(3)]
    for i, event_id in enumerate(ids):
        writes.insert(ledger, {"event_id": event_id, "amount": i})
    [(sql, params)] = _write(writes)
    assert sql == (
        "INSERT INTO ledger (event_id, amount) SELECT * FROM unnest("
        "CAST(%(c0)b AS UUID[]), CAST(%(c1)b AS INTEGER[]))"
    ), "each column one array, sent in binary"
    assert params == {"c0": ids, "c1": [0, 1, 2]}
    assert not writes and _write(writes) == [], "written once, then forgotten"


def test_a_column_psycopg_cannot_send_in_binary_goes_as_text() -> None:
    class Money:  # no psycopg dumper in binary (nor in text: the database would say so)
        pass

    writes = Writes()
    writes.insert(ledger, {"event_id": None, "amount": Money()})
    [(sql, _)] = _write(writes)
    assert "CAST(%(c0)s AS UUID[]), CAST(%(c1)s AS INTEGER[])" in sql, "all None; no dumper"


def test_statements_run_in_the_order_each_was_first_used() -> None:
    writes = Writes()
    writes.insert(Note, {"id": 1, "body": "a"})  # a mapped class is its table
    writes.insert(ledger, {"event_id": uuid.uuid4(), "amount": 1})
    writes.insert(Note, {"id": 2, "body": "b"})
    tables = [sql.split()[2] for sql, _ in _write(writes)]
    assert tables == ["notes", "ledger"]


def test_upserts_of_one_key_merge_as_if_run_one_after_the_other() -> None:
    writes = Writes()
    for n in (1, 2, 3):
        writes.upsert(
            balances, {"account": "a", "first": n, "last": n}, on=["account"], update=["last"]
        )
    writes.upsert(
        balances, {"account": "b", "first": 9, "last": 9}, on=["account"], update=["last"]
    )
    [(sql, params)] = _write(writes)
    assert "ON CONFLICT (account) DO UPDATE SET last = EXCLUDED.last" in sql
    assert params == {"c0": ["a", "b"], "c1": [1, 9], "c2": [3, 9]}


def test_an_upsert_updates_every_other_column_by_default_and_nothing_when_told() -> None:
    writes = Writes()
    writes.upsert(balances, {"account": "a", "first": 1, "last": 1}, on=["account"])
    writes.upsert(balances, {"account": "a", "first": 5, "last": 5}, on=["account"], update=[])
    first, second = (sql for sql, _ in _write(writes))
    assert "DO UPDATE SET first = EXCLUDED.first, last = EXCLUDED.last" in first
    assert second.endswith("ON CONFLICT (account) DO NOTHING")


def test_array_columns_and_python_defaults_go_through_sqlalchemy() -> None:
    writes = Writes()
    writes.insert(tagged, {"tags": ["x", "y"]})
    writes.insert(defaulted, {"n": 1})
    executed = _write(writes)
    assert ["unnest" in sql for sql, _ in executed] == [False, False]
    assert [params for _, params in executed] == [[{"tags": ["x", "y"]}], [{"n": 1}]]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w: w.insert(ledger, {"event_id": None, "amont": 1}), "no column 'amont'"),
        (lambda w: w.insert("ledger", {"amount": 1}), "neither a SQLAlchemy Table"),
        (
            lambda w: w.upsert(balances, {"first": 1}, on=["account"]),
            "the values have no 'account'",
        ),
    ],
    ids=["unknown column", "not a table", "no conflict column"],
)
def test_bad_writes_fail_at_once_naming_what_is_wrong(call: Any, message: str) -> None:
    writes = Writes()
    with pytest.raises(WriteError, match=message):
        call(writes)
    assert not writes, "nothing was collected"
