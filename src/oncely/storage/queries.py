"""Named SQL statements, kept in the packaged ``sql/*.sql`` files (one per area) and loaded once.

A statement starts with a ``-- name: <name>`` line; the comment lines after it document it.
Names are unique across all files. A piece of SQL several statements share is written once,
after a ``-- fragment: <name>`` line, and a statement includes it as ``{name}``.
Code refers to statements by name (``query("idempotency_insert")``), so every claim, settle and
receipt statement is one reviewed piece of SQL with bound ``:parameters``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import fields
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

from oncely.storage.errors import translate

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")

_NAME = re.compile(r"^-- (name|fragment): ([a-z0-9_]+)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"\{([a-z0-9_]+)\}")


@cache
def _load() -> dict[str, str]:
    statements: dict[str, str] = {}
    fragments: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).joinpath("sql").iterdir(), key=str):
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME.split(entry.read_text())
        for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
            if name in statements or name in fragments:
                raise RuntimeError(f"SQL statement {name!r} is defined twice ({entry.name})")
            if kind == "name":
                statements[name] = body.strip()
            else:
                fragments[name] = "\n".join(
                    line for line in body.strip().splitlines() if not line.startswith("--")
                )
    return {
        name: _INCLUDE.sub(lambda m: fragments[m.group(1)], body)
        for name, body in statements.items()
    }


@cache
def query(name: str) -> sa.TextClause:
    """The named statement as a SQLAlchemy ``text()`` construct; ``KeyError`` if unknown."""
    return sa.text(_load()[name])


@cache
def driver_query(name: str) -> str:
    """The named statement in psycopg's own form, for :func:`run_on_driver`: its comment lines
    dropped and each ``:parameter`` a ``%(parameter)b`` placeholder (sent in binary, so that a
    list goes as one binary array without a text conversion per element)."""
    compiled = str(query(name).compile(dialect=PGDialect_psycopg()))  # type: ignore[no-untyped-call]
    text = " ".join(line.strip() for line in compiled.splitlines() if not line.startswith("--"))
    return _PLACEHOLDER.sub(r"%(\1)b", text)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def run_on_driver(
    connection: sa.Connection, statement: str, params: Sequence[Any] | Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Run ``statement`` (psycopg's placeholders) on the DBAPI connection of ``connection``'s
    current transaction; return its rows as the driver's tuples (none when it returns none).

    For the statements oncely runs per event: it skips SQLAlchemy's per-statement and per-row
    work and stays in the caller's transaction (sync or, inside ``AsyncSession.run_sync``,
    async). A unique violation of one of oncely's own constraints raises its
    :class:`~oncely.errors.OncelyError`; any other driver error is raised as SQLAlchemy's
    :class:`~sqlalchemy.exc.DBAPIError`, and a connection the error closed is invalidated.
    """
    dbapi = connection.connection.dbapi_connection
    assert dbapi is not None, "a connection in a transaction has its DBAPI connection"
    cursor = dbapi.cursor()
    try:
        cursor.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description is not None else []
    except psycopg.Error as exc:
        known = translate(exc)
        if known is not None:
            raise known from exc
        if connection.connection.driver_connection.closed:  # type: ignore[union-attr]
            connection.invalidate(exc)
        raise sa.exc.DBAPIError.instance(statement, params, exc, psycopg.Error) from exc
    finally:
        cursor.close()


def typed_row(cls: type[D], row: Mapping[Any, Any], **given: Any) -> D:
    """The dataclass ``cls`` of a statement's result ``row`` (``Row._mapping``): each field the
    value of the column of its name, a field with a default where the row has no such column,
    and the fields ``given`` as given. The statement names its columns after the fields
    (``attempts AS attempt``)."""
    return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row}, **given)


def query_names() -> frozenset[str]:
    return frozenset(_load())


def purge_in_batches(
    engine: sa.Engine, name: str, params: Mapping[str, object], *, batch_size: int
) -> int:
    """Run the named ``DELETE`` (of at most ``:batch_size`` rows) in one transaction at a time
    until it deletes fewer than ``batch_size``; return how many rows it deleted in all.

    Short transactions keep a large purge from holding locks (or bloating one snapshot) long.
    """
    statement = query(name)
    bound = {**params, "batch_size": batch_size}
    total = 0
    while True:
        with engine.begin() as conn:
            deleted = conn.execute(statement, bound).rowcount
        total += deleted
        if deleted < batch_size:
            return total
