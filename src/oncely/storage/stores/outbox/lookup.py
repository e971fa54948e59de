"""The console's reads of single events: one outbox row by id, a key's recent rows, and the rows
an event's effects staged (their ``causationId`` header names it).

Each function runs one statement on the caller's connection and writes nothing. An id lookup
is one probe of the primary key; the key and caused-by lookups read a range of it (UUIDv7 ids
begin with their moment), so their cost is bounded by the window the caller gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query
from oncely.wire import CAUSATION_HEADER

#: What the relay has done with a row: ``published`` (its shard's progress passed it, and it is
#: neither parked nor held), ``unpublished`` (not yet), ``dead``, ``delayed`` or ``blocked``
#: (the row its key is parked on) and ``held`` (behind a parked row of its key).
STATES = ("published", "unpublished", "dead", "delayed", "blocked", "held")


@dataclass(frozen=True, slots=True)
class EventRow:
    """An outbox row with its ``state`` (one of :data:`STATES`) and, when it is parked, the
    ``error`` that parked it. ``headers`` are the row's own (not those the relay adds);
    ``trace_context`` the ``tracingspancontext`` staged with it."""

    id: UUID
    seq: int
    shard: int
    topic: str
    aggregatetype: str
    aggregateid: str
    type: str
    payload: bytes
    headers: dict[str, str]
    created_at: datetime
    available_at: datetime
    trace_context: str | None
    state: str
    error: str | None


@dataclass(frozen=True, slots=True)
class CausedRow:
    """A row an effect of another event staged."""

    id: UUID
    type: str
    topic: str
    aggregateid: str
    created_at: datetime


def _row(r: sa.Row[object]) -> EventRow:
    m = r._mapping
    if not m["passed"]:
        state = "unpublished"
    elif m["parked"] is not None:
        state = str(m["parked"])
    elif m["held"]:
        state = "held"
    else:
        state = "published"
    return EventRow(
        m["id"],
        m["seq"],
        m["shard"],
        m["topic"],
        m["aggregatetype"],
        m["aggregateid"],
        m["type"],
        bytes(m["payload"]),
        {name: str(value) for name, value in json.loads(m["headers"]).items()},
        m["created_at"],
        m["available_at"],
        m["trace_context"],
        state,
        m["error"],
    )


def event(conn: sa.Connection, event_id: UUID) -> EventRow | None:
    """The outbox row ``event_id``, or ``None`` (never staged, or purged)."""
    found = conn.execute(query("lookup_event"), {"id": event_id}).first()
    return None if found is None else _row(found)


def of_key(conn: sa.Connection, key: str, *, low: UUID, high: UUID, limit: int) -> list[EventRow]:
    """The newest ``limit`` rows of aggregate key ``key`` with ids in ``[low, high)``."""
    rows = conn.execute(query("lookup_key"), {"key": key, "low": low, "high": high, "limit": limit})
    return [_row(r) for r in rows]


def caused_by(
    conn: sa.Connection, event_id: UUID, *, low: UUID, high: UUID, limit: int
) -> list[CausedRow]:
    """The rows with ids in ``[low, high)`` whose ``causationId`` header is ``event_id``."""
    rows = conn.execute(
        query("lookup_caused"),
        {"id": str(event_id), "header": CAUSATION_HEADER, "low": low, "high": high, "limit": limit},
    )
    return [CausedRow(r.id, r.type, r.topic, r.aggregateid, r.created_at) for r in rows]
