"""The outbox purge of Debezium mode, where nothing records which rows were published: a purge
mark, the rows it covers, and their deletion once the connector's slot has passed the mark
(:func:`oncely.debezium.purge` checks the slot)."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from oncely.storage.queries import purge_in_batches, query
from oncely.storage.stores.outbox.rows import TopicPurge


@dataclass(frozen=True)
class PurgeMark:
    """A point the connector must pass before the rows it covers may be deleted.

    Attributes:
        xmin: the ``xmin`` (``xid8``, as text) of a snapshot: every transaction whose id is
            lower had finished when the snapshot was taken.
        lsn: the WAL insert position read right after the snapshot (``pg_lsn`` text).
    """

    xmin: str
    lsn: str


def take_mark(conn: sa.Connection) -> PurgeMark:
    """A new mark: the current snapshot's ``xmin`` and the WAL insert position after it."""
    row = conn.execute(query("debezium_purge_mark")).one()
    return PurgeMark(xmin=row.xmin, lsn=row.lsn)


def _params(mark: PurgeMark, older_than_seconds: float) -> dict[str, object]:
    return {"older_than": older_than_seconds, "mark_xmin": mark.xmin}


def covered(conn: sa.Connection, mark: PurgeMark, *, older_than_seconds: float) -> list[TopicPurge]:
    """Per topic: the rows created before the horizon that ``mark`` covers."""
    rows = conn.execute(query("debezium_purge_preview"), _params(mark, older_than_seconds))
    return [TopicPurge(r.topic, r.rows, r.oldest_id, r.oldest_created_at) for r in rows]


def not_covered(conn: sa.Connection, mark: PurgeMark, *, older_than_seconds: float) -> int:
    """How many rows older than the horizon ``mark`` does not cover (a later purge's)."""
    params = _params(mark, older_than_seconds)
    return int(conn.execute(query("debezium_purge_waiting"), params).scalar_one())


def purge_covered(
    engine: sa.Engine, mark: PurgeMark, *, older_than_seconds: float, batch_size: int
) -> int:
    """Delete the rows :func:`covered` counts, ``batch_size`` per transaction; return how many.
    Call it only once the connector's slot has confirmed ``mark.lsn``."""
    params = _params(mark, older_than_seconds)
    return purge_in_batches(engine, "debezium_purge", params, batch_size=batch_size)
