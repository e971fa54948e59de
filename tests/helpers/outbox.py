"""Outbox rows written straight to the table, as a producer stages them, and the count the
relay has acknowledged."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from oncely.storage import outbox
from tests.helpers.database import scalar


def outbox_row(
    topic: str, key: str = "acc-0", *, event_id: uuid.UUID | None = None, **columns: object
) -> dict[str, object]:
    """One outbox row as :func:`oncely.stage` writes it: an ``account.credited`` event of the
    aggregate ``key`` on ``topic``, payload ``{}``, no headers, its event key its id (a new id
    unless ``event_id``); ``columns`` set any other column."""
    event_id = event_id or uuid.uuid4()
    return {
        "id": event_id,
        "aggregatetype": "account",
        "aggregateid": key,
        "type": "account.credited",
        "topic": topic,
        "payload": b"{}",
        "headers": {},
        "event_key": str(event_id),
        **columns,
    }


def outbox_rows(
    count: int, *, topics: Sequence[str], keys: int, payload: bytes = b"x" * 200
) -> list[dict[str, object]]:
    """Rows as a producer would stage them: key i % keys, topic by key, payload as given."""
    return [
        outbox_row(
            topics[(i // keys) % len(topics)],
            f"key-{i % keys}",
            type="test.event",
            payload=payload,
            headers={"content-type": "application/octet-stream", "n": str(i)},
            event_key=f"event-{i}-{uuid.uuid4().hex[:6]}",
        )
        for i in range(count)
    ]


def insert_rows(engine: sa.Engine, rows: Sequence[dict[str, object]]) -> None:
    with engine.begin() as conn:
        for start in range(0, len(rows), 1000):
            conn.execute(sa.insert(outbox), list(rows[start : start + 1000]))


def count_published(engine: sa.Engine) -> int:
    """Rows the relay has recorded as acknowledged (held and dead rows are not counted)."""
    return int(
        scalar(
            engine,
            """
            SELECT count(*) FROM oncely_outbox AS o
            JOIN oncely_relay_shards AS s ON s.shard = o.shard
            WHERE oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
              AND o.id NOT IN (SELECT event_id FROM oncely_relay_held)
              AND o.id NOT IN (SELECT event_id FROM oncely_relay_parked)
            """,
        )
    )
