"""The store of ``oncely_audit``: the operators' audit log, one row per operation carried out.

:func:`record` writes an entry in the caller's transaction, the one that carried out the
operation, so an operation and its entry commit together or not at all; :func:`entries` reads
them back, newest first. The named SQL is in ``storage/sql/audit.sql``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Literal

import sqlalchemy as sa

from oncely.storage.queries import query, typed_row

Via = Literal["cli", "web"]


@dataclass(frozen=True, slots=True)
class Entry:
    """What an operator asked for: ``actor`` (a console user, or the command line's OS user)
    through ``via``, ``action`` (``requeue``, ``skip``, ``reclaim``, ``republish``) on
    ``target`` (row ids, a topic, a task id, a window), how many ``rows`` it changed, and the
    ``reason`` they gave (empty when none)."""

    actor: str
    via: Via
    action: str
    target: str
    rows: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Recorded:
    """An :class:`Entry` as the log holds it, with its ``id`` and the moment (``at``) its
    operation's transaction wrote it."""

    id: int
    at: datetime
    actor: str
    via: str
    action: str
    target: str
    rows: int
    reason: str


def insert(entry: Entry) -> tuple[sa.TextClause, dict[str, object]]:
    """The statement writing ``entry`` and its parameters, for a caller that runs it among its
    own statements (as a step of :func:`oncely.runtime.steps.drive`)."""
    return query("audit_insert"), asdict(entry)


def record(conn: sa.Connection, entry: Entry) -> Recorded:
    """Write ``entry`` in ``conn``'s open transaction (the caller commits it with the
    operation); return it as recorded."""
    row = conn.execute(*insert(entry)).one()
    return Recorded(row.id, row.at, **asdict(entry))


def entries(conn: sa.Connection, *, action: str | None = None, limit: int = 100) -> list[Recorded]:
    """The newest ``limit`` entries (only ``action``'s, when given), newest first."""
    rows = conn.execute(query("audit_list"), {"action": action, "limit": limit})
    return [typed_row(Recorded, row._mapping) for row in rows]
