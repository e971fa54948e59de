"""Named SQL statements, kept in the packaged ``sql/*.sql`` files (one per area) and loaded once.

A statement starts with a ``-- name: <name>`` line; the comment lines after it document it.
Names are unique across all files.
Code refers to statements by name (``query("idempotency_insert")``), so every claim, settle and
receipt statement is one reviewed piece of SQL with bound ``:parameters``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from importlib import resources

import sqlalchemy as sa

_NAME = re.compile(r"^-- name: ([a-z0-9_]+)\s*$", re.MULTILINE)


@cache
def _load() -> dict[str, str]:
    statements: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).joinpath("sql").iterdir(), key=str):
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME.split(entry.read_text())
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in statements:
                raise RuntimeError(f"SQL statement {name!r} is defined twice ({entry.name})")
            statements[name] = body.strip()
    return statements


@cache
def query(name: str) -> sa.TextClause:
    """The named statement as a SQLAlchemy ``text()`` construct; ``KeyError`` if unknown."""
    return sa.text(_load()[name])


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
