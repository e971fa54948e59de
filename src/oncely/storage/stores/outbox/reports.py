"""What operators read from the outbox and the relay's tables: ``oncely status`` (parked keys per
topic), ``oncely verify`` (a window's rows by state) and ``oncely replay --from-outbox`` (a
window's rows and what stops them being republished).

Every function runs one statement on the caller's connection, so several of them agree when the
caller opens one ``REPEATABLE READ`` transaction around them; none of them writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query
from oncely.storage.stores.outbox.rows import OutboxRow

#: Rows fetched per round trip from a server-side cursor.
_CURSOR_ROWS = 1000


@dataclass(frozen=True, slots=True)
class ParkedOfTopic:
    """A topic's parked keys (``dead``, ``delayed``, ``blocked``; ``held_keys`` in all), the rows
    held behind them, dead rows an operator asked to requeue or skip that no relay carried out
    yet, and while the topic is missing (or not authorised) the rows that wait for it
    (``blocked_rows``: the blocked keys' own rows and the rows held behind them) and since when
    (``blocked_since``: the first key blocked; ``blocked_error``: "topic T is missing" or
    "... not authorised")."""

    topic: str
    dead: int
    delayed: int
    held_keys: int
    held_rows: int
    requested: int
    blocked: int = 0
    blocked_rows: int = 0
    blocked_since: datetime | None = None
    blocked_error: str | None = None


def parked_by_topic(conn: sa.Connection) -> list[ParkedOfTopic]:
    """Every topic with a parked key, by name."""
    return [
        ParkedOfTopic(
            r.topic,
            int(r.dead),
            int(r.delayed),
            int(r.held_keys),
            int(r.held_rows),
            r.requested,
            int(r.blocked),
            int(r.blocked_rows),
            r.blocked_since,
            r.blocked_error,
        )
        for r in conn.execute(query("ops_parked_by_topic"))
    ]


@dataclass(frozen=True, slots=True)
class OutboxSummary:
    """A window's rows by state: ``published`` once its shard's progress passed it and it is
    neither a parked key's own row (``dead``, or delayed) nor ``held`` behind one;
    ``unpublished`` before that; ``stuck``: not published and due longer than the allowed age."""

    committed: int
    published: int
    unpublished: int
    dead: int
    held: int
    stuck: int
    oldest_unpublished_seconds: float | None


@dataclass(frozen=True, slots=True)
class StuckRow:
    """A row due but not published; ``state``: ``unpublished``, ``dead`` or ``held``."""

    id: UUID
    topic: str
    aggregateid: str
    state: str
    age_seconds: float
    error: str | None


@dataclass(frozen=True, slots=True)
class PublishedRow:
    """A published row of the window: its id, and the topic it must be found on."""

    id: UUID
    topic: str


def database_now(conn: sa.Connection) -> datetime:
    """The database clock (fixed for a whole ``REPEATABLE READ`` transaction)."""
    now: datetime = conn.execute(query("verify_now")).scalar_one()
    return now


def window_summary(
    conn: sa.Connection, *, since: datetime, until: datetime, max_pending_age: float
) -> OutboxSummary:
    """The rows created in ``[since, until)`` by state."""
    window = {"since": since, "until": until, "max_pending_age": max_pending_age}
    return OutboxSummary(**conn.execute(query("verify_outbox_summary"), window).one()._asdict())


def stuck_rows(
    conn: sa.Connection, *, since: datetime, until: datetime, max_pending_age: float, limit: int
) -> list[StuckRow]:
    """Up to ``limit`` rows of the window that are stuck, oldest first."""
    params = {"since": since, "until": until, "max_pending_age": max_pending_age, "limit": limit}
    return [StuckRow(**row._asdict()) for row in conn.execute(query("verify_stuck"), params)]


def published_rows(
    conn: sa.Connection, *, since: datetime, until: datetime, max_pending_age: float
) -> Iterator[PublishedRow]:
    """The window's published rows, grouped by topic, streamed from a server-side cursor."""
    window = {"since": since, "until": until, "max_pending_age": max_pending_age}
    rows = conn.execute(
        query("verify_published"), window, execution_options={"yield_per": _CURSOR_ROWS}
    )
    return (PublishedRow(row.id, row.topic) for row in rows)


@dataclass(frozen=True, slots=True)
class WindowOfTopic:
    """A republish window's rows of one topic: how many, how many no shard's progress has
    passed yet, how many belong to parked keys."""

    topic: str
    rows: int
    unpublished: int
    parked: int


@dataclass(frozen=True, slots=True)
class RepublishWindow:
    """A republish window per topic, with the oldest row the outbox still holds (``None``: the
    outbox is empty): rows before it were purged unless its ``seq`` is the first. On a
    partitioned outbox, ``first_ranged_seq`` is the lowest ``seq`` outside its default partition
    (``None``: the range partitions hold no row); unpartitioned, it is ``first_seq``."""

    topics: list[WindowOfTopic]
    first_seq: int | None
    first_created_at: datetime | None
    first_ranged_seq: int | None = None


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """A parked key, with the row that parked it and why (``dead`` or ``delayed``)."""

    topic: str
    aggregateid: str
    event_id: UUID
    reason: str


def _window(since: datetime, until: datetime | None, event_type: str | None) -> dict[str, object]:
    return {"since": since, "until": until, "type": event_type}


def republish_window(
    conn: sa.Connection, *, since: datetime, until: datetime | None, event_type: str | None
) -> RepublishWindow:
    """The rows created in ``[since, until)`` (``until`` ``None``: no end), of ``event_type``
    when given, per topic; one scan of the table."""
    summary = conn.execute(query("republish_summary"), _window(since, until, event_type)).all()
    first = summary[0] if summary else None
    return RepublishWindow(
        [
            WindowOfTopic(row.topic, int(row.rows), int(row.unpublished), int(row.parked))
            for row in summary
            if row.topic is not None
        ],
        first.first_seq if first else None,
        first.first_created_at if first else None,
        first.first_ranged_seq if first else None,
    )


def parked_keys_of_window(
    conn: sa.Connection,
    *,
    since: datetime,
    until: datetime | None,
    event_type: str | None,
    limit: int,
) -> list[ParkedKey]:
    """Up to ``limit`` parked keys with rows in the window."""
    params = {**_window(since, until, event_type), "limit": limit}
    return [
        ParkedKey(r.topic, r.aggregateid, r.event_id, r.reason)
        for r in conn.execute(query("republish_parked_keys"), params)
    ]


def window_rows(
    conn: sa.Connection, *, since: datetime, until: datetime | None, event_type: str | None
) -> Iterator[OutboxRow]:
    """The window's rows in ``seq`` order, as the relay reads them, from a server-side cursor."""
    rows = conn.execute(
        query("republish_rows"),
        _window(since, until, event_type),
        execution_options={"yield_per": _CURSOR_ROWS},
    )
    return (OutboxRow.of(columns) for columns in rows)
