"""Rows that effects write with ``ctx.insert`` / ``ctx.upsert``, collected and written per batch.

A consumer applying a batch gives every record's context the same :class:`Writes`; the rows are
written just before the transaction of the receipts commits, one statement per table and column
set, in the order each statement was first used: ``INSERT ... SELECT * FROM unnest(...)`` with
one array parameter per column (each value passed through its column type's bind processor, as
SQLAlchemy would, and sent in binary where psycopg can), so no ORM object is built and the
statement's text is the same for every batch. A table with an ``ARRAY`` column, or with a
Python-side default on a column the values leave out, is written with SQLAlchemy's
``executemany`` instead.

Follow-up events staged with ``ctx.stage`` are outbox rows, written first, all of a batch in one
multi-row ``INSERT`` (:func:`~oncely.storage.stores.outbox.writes.add_rows`).

Upserts of one key in one batch are merged before they are written, as if they had run one
after the other: the first one's values for the columns it does not update, the last one's for
those it does. A row that breaks a constraint fails the statement; the consumer then applies the
batch again record by record, where each record's rows are written in its own savepoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.adapt import AdaptersMap, PyFormat
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from oncely.errors import ConfigurationError
from oncely.storage.queries import run_on_driver
from oncely.storage.stores.outbox.writes import add_rows

#: A table an effect writes to: a Core ``Table`` or an ORM-mapped class.
TableLike = sa.Table | type[Any]


class WriteError(ConfigurationError):
    """``ctx.insert`` / ``ctx.upsert`` was given a table or a column that does not exist."""


@dataclass(frozen=True, slots=True)
class _Statement:
    table: sa.Table
    columns: tuple[str, ...]
    on: tuple[str, ...] | None  # None: a plain INSERT
    update: tuple[str, ...]

    def compiled(self) -> sa.Insert:
        if self.on is None:
            return sa.insert(self.table)
        statement = postgresql.insert(self.table)
        if not self.update:
            return statement.on_conflict_do_nothing(index_elements=list(self.on))
        return statement.on_conflict_do_update(
            index_elements=list(self.on),
            set_={name: statement.excluded[name] for name in self.update},
        )


class Writes:
    """The rows of one transaction: the outbox rows of its follow-up events, then the others by
    statement, in the order the statements were first used."""

    def __init__(self) -> None:
        # By (table as given, column names, conflict columns, updated columns): the statement
        # and its rows (upserts: by conflict key), in the order the statements were first used.
        self._inserts: dict[tuple[Any, ...], tuple[_Statement, list[dict[str, Any]]]] = {}
        self._upserts: dict[
            tuple[Any, ...], tuple[_Statement, dict[tuple[Any, ...], dict[str, Any]]]
        ] = {}
        self._order: list[tuple[_Statement, list[dict[str, Any]] | dict[Any, dict[str, Any]]]] = []
        self._outbox: list[Mapping[str, Any]] = []

    def insert(self, table: TableLike, values: Mapping[str, Any]) -> None:
        key: tuple[Any, ...] = (table, tuple(values))
        found = self._inserts.get(key)
        if found is None:
            statement = _statement(key[0], key[1], None, ())
            found = self._inserts[key] = (statement, [])
            self._order.append(found)
        found[1].append(dict(values))

    def upsert(
        self,
        table: TableLike,
        values: Mapping[str, Any],
        *,
        on: Sequence[str],
        update: Sequence[str] | None = None,
    ) -> None:
        keys = tuple(on)
        updated = tuple(update) if update is not None else tuple(c for c in values if c not in keys)
        statement_key: tuple[Any, ...] = (table, tuple(values), keys, updated)
        found = self._upserts.get(statement_key)
        if found is None:
            statement = _statement(*statement_key)
            found = self._upserts[statement_key] = (statement, {})
            self._order.append(found)
        rows = found[1]
        key = tuple(values[name] for name in keys)
        earlier = rows.get(key)
        if earlier is None:
            rows[key] = dict(values)
        else:
            earlier.update({name: values[name] for name in updated})

    def stage(self, row: Mapping[str, Any]) -> None:
        """Add an outbox ``row`` (a follow-up event), written before the other rows."""
        self._outbox.append(row)

    def __bool__(self) -> bool:
        return bool(self._order) or bool(self._outbox)

    def clear(self) -> None:
        self._inserts.clear()
        self._upserts.clear()
        self._order.clear()
        self._outbox.clear()

    def write(self, session: Session) -> None:
        """Execute the collected rows in ``session``'s transaction, then forget them."""
        connection = session.connection()
        adapters = connection.connection.driver_connection.adapters  # type: ignore[union-attr]
        add_rows(connection, self._outbox)
        for statement, params in self.statements(connection.dialect, adapters):
            if isinstance(statement, str):
                run_on_driver(connection, statement, params)
            else:
                session.execute(statement, params)
        self.clear()

    def statements(
        self, dialect: sa.Dialect, adapters: AdaptersMap
    ) -> list[tuple[str | sa.Insert, Any]]:
        """What :meth:`write` executes, in order: psycopg's text of an ``unnest`` statement and
        its array per column, or a SQLAlchemy ``Insert`` and its rows (``executemany``)."""
        result: list[tuple[str | sa.Insert, Any]] = []
        for statement, rows in self._batches():
            unnest = _unnest(statement, dialect)
            if unnest is None:
                result.append((statement.compiled(), rows))
                continue
            head, casts, processors = unnest
            params = _columns(statement.columns, processors, rows)
            arrays = ", ".join(
                cast.format(_placeholder(f"c{i}", values, adapters))
                for i, (cast, values) in enumerate(zip(casts, params.values(), strict=True))
            )
            result.append((head.format(arrays=arrays), params))
        return result

    def _batches(self) -> Iterator[tuple[_Statement, list[dict[str, Any]]]]:
        for statement, rows in self._order:
            yield statement, rows if isinstance(rows, list) else list(rows.values())


@functools.lru_cache(maxsize=1024)
def _statement(
    table: TableLike, columns: tuple[str, ...], on: tuple[str, ...] | None, update: tuple[str, ...]
) -> _Statement:
    """The statement writing ``columns`` into ``table`` (a :data:`TableLike`), checked once."""
    statement = _Statement(_table_of(table), columns, on, update)
    _check(statement)
    return statement


def _table_of(table: TableLike) -> sa.Table:
    if isinstance(table, sa.Table):
        return table
    mapped = getattr(table, "__table__", None)
    if isinstance(mapped, sa.Table):
        return mapped
    raise WriteError(
        f"{table!r} is neither a SQLAlchemy Table nor a mapped class: pass the model class or "
        "its __table__"
    )


def _check(statement: _Statement) -> None:
    table = statement.table
    named = [*statement.columns, *(statement.on or ()), *statement.update]
    unknown = sorted({name for name in named if name not in table.c})
    if unknown:
        raise WriteError(
            f"table {table.name!r} has no column {', '.join(map(repr, unknown))}: use the "
            "column names of the table (not the mapped attribute names)"
        )
    missing = [
        name for name in (statement.on or ()) + statement.update if name not in statement.columns
    ]
    if missing:
        raise WriteError(
            f"upsert into {table.name!r}: the values have no {', '.join(map(repr, missing))}; give "
            "a value for every conflict and updated column"
        )


Processor = Callable[[Any], Any] | None


@functools.lru_cache(maxsize=1024)
def _unnest(
    statement: _Statement, dialect: sa.Dialect
) -> tuple[str, tuple[str, ...], tuple[Processor, ...]] | None:
    """The statement as one ``INSERT ... SELECT * FROM unnest({arrays})`` in psycopg's form, the
    cast of each column's array (``{}`` for its placeholder), and the bind processor of each
    column; ``None`` when a column type or default does not allow it."""
    table = statement.table
    columns = [table.c[name] for name in statement.columns]
    if any(isinstance(column.type, sa.ARRAY) for column in columns):
        return None
    omitted = [column for column in table.c if column.name not in statement.columns]
    if any(column.default is not None for column in omitted):
        return None
    quote = dialect.identifier_preparer.quote
    names = ", ".join(quote(column.name) for column in columns)
    table_name = dialect.identifier_preparer.format_table(table)
    sql = f"INSERT INTO {table_name} ({names}) SELECT * FROM unnest({{arrays}})"
    if statement.on is not None:
        keys = ", ".join(quote(name) for name in statement.on)
        if statement.update:
            updates = ", ".join(f"{quote(n)} = EXCLUDED.{quote(n)}" for n in statement.update)
            sql += f" ON CONFLICT ({keys}) DO UPDATE SET {updates}"
        else:
            sql += f" ON CONFLICT ({keys}) DO NOTHING"
    casts = tuple(
        "CAST({} AS " + column.type.compile(dialect=dialect).replace("%", "%%") + "[])"
        for column in columns
    )
    processors = tuple(
        column.type.dialect_impl(dialect).bind_processor(dialect) for column in columns
    )
    return sql.replace("%", "%%"), casts, processors


def _columns(
    names: tuple[str, ...], processors: tuple[Processor, ...], rows: list[dict[str, Any]]
) -> dict[str, list[Any]]:
    """One list per column (``c0``, ``c1``...), each value through its column's processor."""
    params: dict[str, list[Any]] = {}
    for i, (name, process) in enumerate(zip(names, processors, strict=True)):
        values = [row[name] for row in rows]
        params[f"c{i}"] = values if process is None else [process(v) for v in values]
    return params


def _placeholder(name: str, values: list[Any], adapters: AdaptersMap) -> str:
    """``name``'s placeholder: binary (one array, no text conversion per element) when psycopg
    can send its values so; text otherwise (all ``None``, or a type without a binary form)."""
    first = next((value for value in values if value is not None), None)
    if first is None:
        return f"%({name})s"
    try:
        adapters.get_dumper(type(first), PyFormat.BINARY)
    except psycopg.ProgrammingError:
        return f"%({name})s"
    return f"%({name})b"
