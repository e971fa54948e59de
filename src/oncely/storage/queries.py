"""Named SQL statements, kept in the packaged ``sql/queries.sql`` and loaded once.

A statement starts with a ``-- name: <name>`` line; the comment lines after it document it.
Code refers to statements by name (``query("idempotency_insert")``), so every claim, settle and
receipt statement is one reviewed piece of SQL with bound ``:parameters``.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

import sqlalchemy as sa

_NAME = re.compile(r"^-- name: ([a-z0-9_]+)\s*$", re.MULTILINE)


@cache
def _load() -> dict[str, str]:
    text = resources.files(__package__).joinpath("sql", "queries.sql").read_text()
    parts = _NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def query(name: str) -> sa.TextClause:
    """The named statement as a SQLAlchemy ``text()`` construct; ``KeyError`` if unknown."""
    return sa.text(_load()[name])


def query_names() -> frozenset[str]:
    return frozenset(_load())
