"""Outbox rows written straight to the table, as a producer stages them; what a relay records
of them (every row acknowledged, a key parked with rows held behind it); the count the relay
has acknowledged."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa

from oncely.ids import uuid7
from oncely.storage import outbox
from oncely.storage.tables import shard_of
from tests.helpers.database import Bind, execute, scalar


def outbox_row(
    topic: str, key: str = "acc-0", *, event_id: uuid.UUID | None = None, **columns: object
) -> dict[str, object]:
    """One outbox row as :func:`oncely.stage` writes it: an ``account.credited`` event of the
    aggregate ``key`` on ``topic``, payload ``{}``, no headers, its event key its id (a new
    UUIDv7 as stage() makes, unless ``event_id``: so rows land in their time's partition of a
    partitioned outbox, not in its default one); ``columns`` set any other column."""
    event_id = event_id or uuid7()
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
            # 64 random bits: with 24, the 40 batches of 2,000 rows of test_relay_wakeup
            # repeated an event key (a unique violation) in about one run in ten.
            event_key=f"event-{i}-{uuid.uuid4().hex[:16]}",
        )
        for i in range(count)
    ]


def staged_rows(
    codec: object, events: Sequence[tuple[uuid.UUID, object]]
) -> list[dict[str, object]]:
    """The outbox rows :func:`oncely.stage` writes for ``events`` (id, event): each on its
    type's topic under its key, encoded by ``codec`` (value and headers)."""
    from pydantic import BaseModel

    from oncely.schemas.codec import Codec

    assert isinstance(codec, Codec)
    rows = []
    for event_id, event in events:
        assert isinstance(event, BaseModel)
        event_type = codec.registry.for_model(type(event))
        value, headers = codec.encode(event)
        rows.append(
            outbox_row(
                event_type.topic,
                event_type.key_of(event),
                event_id=event_id,
                aggregatetype=event_type.aggregate,
                type=event_type.name,
                payload=value,
                headers=headers,
            )
        )
    return rows


def insert_rows(engine: sa.Engine, rows: Sequence[dict[str, object]]) -> None:
    with engine.begin() as conn:
        for start in range(0, len(rows), 1000):
            conn.execute(sa.insert(outbox), list(rows[start : start + 1000]))


def acknowledge_all(bind: Bind) -> None:
    """What a relay records once every row committed so far is acknowledged."""
    execute(bind, "UPDATE oncely_relay_shards SET done = pg_current_snapshot()")


def park(
    bind: Bind,
    row: dict[str, object],
    reason: str = "dead",
    *,
    held: Sequence[dict[str, object]] = (),
    error: str | None = None,
    until_seconds: float | None = None,
    request: str | None = None,
    shards: int = 32,
) -> None:
    """Park ``row``'s key as the relay does (``dead``: it failed for good; ``delayed``: retried
    in ``until_seconds``), the rows ``held`` behind it, with an operator's ``request`` if any."""
    topic, key = str(row["topic"]), str(row["aggregateid"])
    execute(
        bind,
        "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, error, "
        "until, request) VALUES (:t, :k, :s, :e, :r, :err, "
        "now() + make_interval(secs => CAST(:u AS double precision)), :q)",
        t=topic,
        k=key,
        s=shard_of(topic, key, shards),
        e=row["id"],
        r=reason,
        err=error,
        u=until_seconds,
        q=request,
    )
    for held_row in held:
        execute(
            bind,
            "INSERT INTO oncely_relay_held (event_id, topic, aggregateid) VALUES (:e, :t, :k)",
            e=held_row["id"],
            t=topic,
            k=key,
        )


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


def uuid7_at(moment: datetime) -> uuid.UUID:
    """A new UUIDv7 of ``moment``'s millisecond (the partition of that time holds its row)."""
    return uuid7(moment)
