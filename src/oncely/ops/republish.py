"""Republish outbox rows of a time window straight to Kafka, through the relay's record path.

``oncely replay --from-outbox`` sends the rows created in ``[since, until)`` (of one event type,
when given) again, in ``seq`` order, as the relay sends them: the same
:class:`~oncely.storage.stores.outbox.rows.OutboxRow` to record mapping (topic, key, value,
``id`` and ``eventType`` headers then the row's own, timestamp = ``created_at``) and the same
idempotent :class:`~oncely.relay.publisher.Publisher` (``acks=all``, murmur2 partitioning).
The event ids are the original ones, so the effects' receipts absorb the copies; nothing in the
database changes (the rows are immutable, the relay's progress is not touched).

:func:`plan_republish` counts the window and refuses (:class:`RepublishError`) a window that
cannot be republished faithfully:

- rows of it were **purged**: the window starts before the oldest row the outbox still holds,
  and rows before that one were deleted (its ``seq`` is not the first); on a partitioned
  outbox also when it starts before the oldest range partition left and rows before it were
  dropped (the lowest ``seq`` outside the default partition is not the first). Retention drops
  partitions by event id, not by ``created_at``, and rows in the default partition stay, so the
  oldest row left says nothing there;
- a key with rows in it is **parked** (a dead or delayed row): its rows would pass the dead
  row; requeue or skip it first;
- rows of it are **not published yet** (no shard's progress has passed them): a copy sent
  now could reach the topic before an earlier event of its key; wait for the relay.

:func:`republish` checks the same in the snapshot it reads the rows from, then produces them
and waits for every delivery report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import KafkaError, Message

from oncely.errors import OncelyError
from oncely.relay.publisher import Publisher
from oncely.storage import partitions
from oncely.storage.stores.outbox.reports import (
    parked_keys_of_window,
    republish_window,
    window_rows,
)
from oncely.storage.stores.outbox.rows import OutboxRow

#: Parked keys named in the error, at most.
_PARKED_SHOWN = 5


class RepublishError(OncelyError):
    """The window cannot be republished as asked, or records were not delivered."""


@dataclass(frozen=True, slots=True)
class RepublishPlan:
    """The window: rows per topic (all acknowledged, none of a parked key, none purged)."""

    since: datetime
    until: datetime | None
    event_type: str | None
    topics: dict[str, int]

    @property
    def rows(self) -> int:
        return sum(self.topics.values())


Tally = Callable[[int, int], None]
"""Called with (records delivered so far, records to deliver)."""


def _window(since: datetime, until: datetime | None, event_type: str | None) -> dict[str, Any]:
    if until is not None and since >= until:
        raise RepublishError(
            f"the window [{since.isoformat()}, {until.isoformat()}) is empty: --since must be "
            "earlier than --until"
        )
    return {"since": since, "until": until, "event_type": event_type}


def _check(conn: sa.Connection, window: dict[str, Any]) -> RepublishPlan:
    summary = republish_window(conn, **window)
    if summary.first_seq is None or summary.first_created_at is None:
        raise RepublishError(
            "the outbox is empty: nothing to republish (purged rows are gone; replay the topics "
            "from Kafka instead: oncely replay --app ... --effect ... --to-datetime ...)"
        )
    if window["since"] < summary.first_created_at and summary.first_seq > 1:
        raise RepublishError(
            f"rows of the window were purged: the oldest row left in the outbox was created at "
            f"{summary.first_created_at.isoformat()} and earlier ones were deleted (relay "
            "retention ONCELY_RELAY_RETENTION_SECONDS, or oncely relay purge). Start --since at "
            "or after it, or replay the topics from Kafka (oncely replay --app ... --effect ... "
            "--to-datetime ...)"
        )
    retained = _oldest_partition(conn)
    first_seq = summary.first_ranged_seq or summary.first_seq
    if retained is not None and window["since"] < retained and first_seq > 1:
        raise RepublishError(
            f"rows of the window were purged: retention dropped the outbox's partitions before "
            f"{retained.isoformat()}, where the oldest one left starts (rows in the default "
            "partition do not count). Start --since at or after it, or replay the topics from "
            "Kafka (oncely replay --app ... --effect ... --to-datetime ...)"
        )
    topics = summary.topics
    parked = sum(row.parked for row in topics)
    if parked:
        keys = parked_keys_of_window(conn, **window, limit=_PARKED_SHOWN)
        named = ", ".join(
            f"{k.topic} key {k.aggregateid!r} ({k.reason} row {k.event_id})" for k in keys
        )
        raise RepublishError(
            f"{parked} row(s) of the window belong to parked keys: {named}. Their rows would "
            "pass the parked row: requeue or skip it first (oncely dead list|requeue|skip), or "
            "choose a window without them"
        )
    unpublished = sum(row.unpublished for row in topics)
    if unpublished:
        raise RepublishError(
            f"{unpublished} row(s) of the window are not published yet: a copy sent now could "
            "reach Kafka before an earlier event of its key. Wait for the relay (oncely status "
            "shows the backlog) or end the window earlier (--until)"
        )
    return RepublishPlan(
        window["since"],
        window["until"],
        window["event_type"],
        {row.topic: row.rows for row in topics},
    )


def _oldest_partition(conn: sa.Connection) -> datetime | None:
    """Where the oldest range partition of a partitioned outbox starts (``None``:
    unpartitioned, or no range partition)."""
    ranged = [p for p in partitions.partitions(conn, "oncely_outbox") if not p.is_default]
    return ranged[0].lower if ranged else None


def _snapshot(engine: sa.Engine) -> sa.Connection:
    return engine.connect().execution_options(
        isolation_level="REPEATABLE READ", postgresql_readonly=True
    )


def plan_republish(
    engine: sa.Engine, *, since: datetime, until: datetime | None, event_type: str | None
) -> RepublishPlan:
    """What :func:`republish` would send (aware datetimes; ``until`` ``None``: no end).

    Changes nothing. Raises :class:`RepublishError` when rows of the window were purged, belong
    to parked keys, or are not published yet (see the module's documentation), or for an empty
    window; SQLAlchemy's errors propagate.
    """
    window = _window(since, until, event_type)
    with _snapshot(engine) as conn, conn.begin():
        return _check(conn, window)


def republish(
    engine: sa.Engine,
    *,
    publisher: Publisher,
    since: datetime,
    until: datetime | None,
    event_type: str | None,
    progress: Tally | None = None,
    timeout: float = 60.0,
) -> RepublishPlan:
    """Send the window's rows to Kafka again, in ``seq`` order, with their original event ids.

    The checks of :func:`plan_republish` run in the snapshot the rows are read from. Returns
    the plan once every record has a successful delivery report. Raises
    :class:`RepublishError` when a check fails (nothing is sent), or when records fail or get
    no report within ``timeout`` seconds after the last one was produced (the others may have
    been delivered: running it again sends copies, which receipts absorb).
    """
    window = _window(since, until, event_type)
    delivered = 0
    failures: list[tuple[UUID, KafkaError]] = []

    def report_of(row: OutboxRow) -> Callable[[KafkaError | None, Message | None], None]:
        def report(error: KafkaError | None, message: Message | None) -> None:
            nonlocal delivered
            if error is not None:
                failures.append((row.id, error))
                return
            delivered += 1
            if progress is not None:
                progress(delivered, plan.rows)

        return report

    with _snapshot(engine) as conn, conn.begin():
        plan = _check(conn, window)
        for row in window_rows(conn, **window):
            refused = publisher.produce(row, report_of(row))
            if refused is not None:
                failures.append((row.id, refused))
            publisher.poll(0)
    missing = publisher.flush(timeout)
    if failures or missing:
        first = f": {failures[0][1].str()} (row {failures[0][0]})" if failures else ""
        raise RepublishError(
            f"{len(failures)} record(s) failed and {missing} got no delivery report within "
            f"{timeout:g} s{first}; {delivered} of {plan.rows} were delivered. Fix the cause "
            "and run it again: the copies carry the same event ids, receipts absorb them"
        )
    return plan
