"""How producers add outbox rows: in the caller's own transaction, never committing it
(:mod:`oncely.storage.transactional`); and what a transaction has added so far."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import Session

from oncely.storage.queries import query, run_on_driver, typed_row
from oncely.storage.tables import outbox
from oncely.storage.transactional import Transactional, TransactionalTable

#: Rows per statement at most (10 parameters each, PostgreSQL takes up to 65,535 in one).
_MAX_ROWS = 1000


@cache
def _stage_parts() -> tuple[str, str, tuple[str, ...]]:
    """``outbox_stage`` compiled once for psycopg, without its comment: the text up to
    ``VALUES``, the VALUES row (``%s`` parameters) and the names of its parameters, in order."""
    dialect = PGDialect_psycopg(paramstyle="format")  # type: ignore[no-untyped-call]
    compiled = query("outbox_stage").compile(dialect=dialect)
    text = " ".join(
        line.strip() for line in str(compiled).splitlines() if not line.startswith("--")
    )
    head, _, row = text.rpartition(" VALUES ")
    return head + " VALUES ", row, tuple(compiled.positiontup or ())


@lru_cache(maxsize=64)
def _stage_sql(rows: int) -> str:
    """``outbox_stage`` for ``rows`` rows: its VALUES row repeated (cached per batch size, as
    psycopg prepares each text once per connection)."""
    head, row, _ = _stage_parts()
    return head + ", ".join([row] * rows)


_HEADERS_JSON: dict[tuple[tuple[str, str], ...], str] = {}


def _headers_json(headers: Mapping[str, str]) -> str:
    """``headers`` as JSON text; remembered, as most events of a type carry the same headers
    (the codec's content type and schema version)."""
    key = tuple(headers.items())
    text = _HEADERS_JSON.get(key)
    if text is None:
        if len(_HEADERS_JSON) >= 256:
            _HEADERS_JSON.clear()
        text = _HEADERS_JSON[key] = json.dumps(dict(headers), separators=(",", ":"))
    return text


@dataclass(frozen=True, kw_only=True)
class StagedEvent:
    """What was added to the outbox (it becomes durable when the caller commits)."""

    id: UUID
    idempotency_key: str
    """The producer's idempotency key (the outbox's ``event_key`` column)."""
    type: str
    topic: str
    aggregatetype: str
    aggregateid: str
    headers: Mapping[str, str]
    payload: bytes


def _insert(connection: sa.Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """One ``outbox_stage`` INSERT per 1,000 rows, on the DBAPI connection of the caller's
    transaction (or savepoint), without SQLAlchemy's per-statement work."""
    _, _, names = _stage_parts()
    for start in range(0, len(rows), _MAX_ROWS):
        chunk = rows[start : start + _MAX_ROWS]
        params = [
            _headers_json(row["headers"]) if name == "headers" else row.get(name)
            for row in chunk
            for name in names
        ]
        run_on_driver(connection, _stage_sql(len(chunk)), params)


_OUTBOX = TransactionalTable(
    outbox,
    key="event_key",
    what="idempotency key",
    hint="give each event its own idempotency_key (or leave it None to use the event id)",
    insert=_insert,
)


def add_rows(target: Transactional, rows: Sequence[Mapping[str, Any]]) -> None:
    """Add ``rows`` (column -> value) to the outbox in ``target``'s transaction: at once with a
    ``Session`` or ``Connection`` (one statement per 1,000 rows), at the next flush with an
    ``AsyncSession`` (this never awaits). They become durable when the caller commits.

    Raises:
        DuplicateInTransactionError: an ``event_key`` given earlier in this transaction, or
            twice in ``rows``; nothing was added.
        DuplicateEventError: a row's ``event_key`` is already in the outbox (with an
            ``AsyncSession``: at flush or commit).
        sqlalchemy.exc.DBAPIError: any other database error, wrapped as SQLAlchemy would.
    """
    _OUTBOX.add(target, rows)


def staged_in(session: Session) -> list[StagedEvent]:
    """The rows ``session``'s current transaction has added so far, in ``seq`` order."""
    columns = outbox.c
    rows = session.execute(
        sa.select(
            columns.id,
            columns.event_key.label("idempotency_key"),
            columns.type,
            columns.topic,
            columns.aggregatetype,
            columns.aggregateid,
            columns.headers,
            columns.payload,
        )
        .where(columns.txid == sa.func.pg_current_xact_id())
        .order_by(columns.seq)
    )
    return [typed_row(StagedEvent, row._mapping) for row in rows]
