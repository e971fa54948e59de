"""Debezium mode's replication slots and purge, with database I/O: a slot's status, dropping a
slot once its connector is gone for good, and deleting only the outbox rows the connector's slot
has confirmed (:func:`purge`). In Debezium mode nothing records the relay's progress, so this
purge, not the relay's, removes published rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import sqlalchemy as sa

from oncely.debezium.connector import check_identifier
from oncely.errors import ConfigurationError, OncelyError
from oncely.storage.queries import query
from oncely.storage.stores.outbox import debezium as outbox
from oncely.storage.stores.outbox.debezium import PurgeMark
from oncely.storage.stores.outbox.rows import TopicPurge


class SlotInUseError(OncelyError):
    """The replication slot is still held by a running connector."""


def slot_status(engine: sa.Engine, slot_name: str) -> dict[str, object] | None:
    """The replication slot's row (``active``, ``retained_wal_bytes``...), or ``None``."""
    params = {"slot_name": check_identifier("slot name", slot_name)}
    with engine.connect() as conn:
        row = conn.execute(query("debezium_slot_status"), params).mappings().first()
    return dict(row) if row is not None else None


def drop_slot(engine: sa.Engine, slot_name: str, *, timeout: float = 30.0) -> bool:
    """Drop the connector's replication slot once no walsender holds it.

    An idle slot keeps every WAL segment from its position on, so drop it when the connector is
    removed for good (the next connector snapshots the rows again: every retained row oncely's
    relay has not published, as nothing records Debezium's progress in the database). Waits up
    to ``timeout`` seconds for a stopping connector to let go of the slot. Returns whether a
    slot was dropped (``False``: there was none).

    Raises:
        SlotInUseError: the slot is still active after ``timeout`` seconds: stop the connector
            first.
    """
    deadline = time.monotonic() + timeout
    while True:
        status = slot_status(engine, slot_name)
        if status is None:
            return False
        if not status["active"]:
            with engine.begin() as conn:
                dropped = conn.execute(query("debezium_drop_slot"), {"slot_name": slot_name})
                if dropped.first() is not None:
                    return True
        if time.monotonic() > deadline:
            raise SlotInUseError(
                f"replication slot {slot_name!r} is still in use after {timeout:.0f} s: stop or "
                "delete the Debezium connector that reads it, then drop the slot"
            )
        time.sleep(0.2)


class PurgeRefusedError(OncelyError):
    """The purge cannot tell which rows the connector has read, so it deletes nothing."""


class SlotNotFoundError(PurgeRefusedError, ConfigurationError):
    """No replication slot to check the purge against (or more than one candidate)."""


class SlotBehindError(PurgeRefusedError):
    """The connector's slot has not confirmed the WAL position the purge needs."""


@dataclass(frozen=True)
class PurgeSlot:
    """The connector's logical replication slot as a purge sees it."""

    name: str
    plugin: str
    active: bool
    confirmed_flush_lsn: str | None
    #: Whether ``confirmed_flush_lsn`` is at or past the mark's ``lsn`` it was read against.
    passed: bool
    #: Bytes of WAL between ``confirmed_flush_lsn`` and the mark's ``lsn`` (0 once passed).
    behind_bytes: int


@dataclass(frozen=True)
class PurgePlan:
    """What ``oncely debezium purge`` deletes: the rows the mark covers, per topic.

    ``waiting`` counts the rows older than the horizon that the mark does not cover (written
    by transactions still running at the mark): they stay for a later purge.
    """

    slot: PurgeSlot
    mark: PurgeMark
    topics: list[TopicPurge]
    waiting: int

    @property
    def rows(self) -> int:
        return sum(topic.rows for topic in self.topics)


@dataclass(frozen=True)
class PurgeResult:
    """What :func:`purge` did: its plan, the slot once it confirmed the mark, rows deleted."""

    plan: PurgePlan
    slot: PurgeSlot
    deleted: int


def _purge_slots(conn: sa.Connection, lsn: str | None) -> list[PurgeSlot]:
    rows = conn.execute(query("debezium_purge_slots"), {"lsn": lsn}).all()
    return [
        PurgeSlot(
            r.slot_name, r.plugin, r.active, r.confirmed_flush_lsn, r.passed, int(r.behind_bytes)
        )
        for r in rows
    ]


def _pick_slot(slots: list[PurgeSlot], slot_name: str | None, database: str) -> PurgeSlot:
    if slot_name is not None:
        for candidate in slots:
            if candidate.name == slot_name:
                return candidate
        raise SlotNotFoundError(
            f"no logical replication slot {slot_name!r} in database {database!r}: start the "
            "connector (it creates its slot), or name its slot with --slot-name"
        )
    if not slots:
        raise SlotNotFoundError(
            f"no logical replication slot in database {database!r}: no connector reads this "
            "outbox, so its rows may never have been published (start the connector first)"
        )
    if len(slots) > 1:
        names = ", ".join(candidate.name for candidate in slots)
        raise SlotNotFoundError(
            f"database {database!r} has {len(slots)} logical replication slots ({names}): name "
            "the connector's with --slot-name"
        )
    return slots[0]


def purge_plan(
    engine: sa.Engine, *, older_than_seconds: float, slot_name: str | None = None
) -> PurgePlan:
    """Take a purge mark and report what it covers; deletes nothing (the dry run).

    The slot is ``slot_name``, or the only logical replication slot of the database when
    ``None``. ``plan.slot.passed`` tells whether the slot already confirmed the new mark.

    Raises:
        SlotNotFoundError: there is no such slot, no logical slot at all, or (``slot_name``
            omitted) more than one.
        ConfigurationError: ``slot_name`` is not a valid slot name.
    """
    if slot_name is not None:
        check_identifier("slot name", slot_name)
    with engine.connect() as conn:
        database = str(conn.execute(sa.text("SELECT current_database()")).scalar_one())
        _pick_slot(_purge_slots(conn, None), slot_name, database)
        mark = outbox.take_mark(conn)
        slot = _pick_slot(_purge_slots(conn, mark.lsn), slot_name, database)
        topics = outbox.covered(conn, mark, older_than_seconds=older_than_seconds)
        waiting = outbox.not_covered(conn, mark, older_than_seconds=older_than_seconds)
    return PurgePlan(slot=slot, mark=mark, topics=topics, waiting=waiting)


def wait_for_slot(
    engine: sa.Engine, slot_name: str, mark: PurgeMark, *, timeout: float
) -> PurgeSlot:
    """Wait up to ``timeout`` seconds for the slot to confirm ``mark.lsn``; return it then.

    Debezium confirms a position when it flushes its offsets (``offset.flush.interval.ms``,
    60 s by default) after reading a change past it, so an active slot lags a little.

    Raises:
        SlotNotFoundError: the slot was dropped meanwhile.
        SlotBehindError: the slot is inactive (no connector reads it) and behind the mark, or
            still behind after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            database = str(conn.execute(sa.text("SELECT current_database()")).scalar_one())
            slot = _pick_slot(_purge_slots(conn, mark.lsn), slot_name, database)
        if slot.passed:
            return slot
        if not slot.active:
            raise SlotBehindError(
                f"replication slot {slot.name!r} is inactive (no connector reads it) and has "
                f"confirmed WAL up to {slot.confirmed_flush_lsn} only, {slot.behind_bytes} bytes "
                f"before {mark.lsn}: rows it has not read would be lost; start the connector, "
                "or drop the slot if the connector is gone for good"
            )
        if time.monotonic() >= deadline:
            raise SlotBehindError(
                f"replication slot {slot.name!r} has confirmed WAL up to "
                f"{slot.confirmed_flush_lsn} only, {slot.behind_bytes} bytes before {mark.lsn}, "
                f"after {timeout:g} s: the connector confirms a position when it flushes its "
                "offsets after a later change; run the purge again later, or with a longer --wait"
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def purge_marked(
    engine: sa.Engine, mark: PurgeMark, *, older_than_seconds: float, batch_size: int = 5000
) -> int:
    """Delete the rows ``mark`` covers that were created before the horizon; return how many.

    Call it only once the connector's slot confirmed ``mark.lsn`` (:func:`wait_for_slot`).
    Deletes in batches of ``batch_size``, one transaction each.
    """
    return outbox.purge_covered(
        engine, mark, older_than_seconds=older_than_seconds, batch_size=batch_size
    )


def purge(
    engine: sa.Engine,
    *,
    older_than_seconds: float,
    slot_name: str | None = None,
    wait_seconds: float = 120.0,
    batch_size: int = 5000,
) -> PurgeResult:
    """Delete the outbox rows older than the horizon that the connector has read.

    For Debezium mode, where nothing records which rows were published. A row stores no WAL
    position, so the purge proves "read" with a mark (:class:`PurgeMark`): the ``xmin`` of a
    fresh snapshot, and the WAL insert position ``L`` read right after it. A row whose version
    was written by a transaction older than ``xmin`` was committed before the snapshot, so its
    commit record lies before ``L``. Once the connector's slot has confirmed ``L``
    (``confirmed_flush_lsn >= L``), the connector has received every such row: streamed from
    the WAL, or read by the snapshot it took when its slot was created (a slot created after
    the row committed starts past it; that snapshot holds the rows it reads, so a delete does not
    hide them from it). The purge then deletes those rows created before the horizon; rows
    written later, or by transactions still running at the mark, stay.

    Waits up to ``wait_seconds`` for the slot to confirm ``L``. Returns the plan (what the mark
    covered per topic when it was taken), the slot once it confirmed the mark, and how many
    rows were deleted.

    Raises:
        SlotNotFoundError: no slot ``slot_name`` (or, ``None``, not exactly one logical slot in
            the database): a configuration error; nothing deleted.
        SlotBehindError: the slot is inactive and behind ``L``, or did not confirm ``L`` in
            time; nothing deleted.
    """
    plan = purge_plan(engine, older_than_seconds=older_than_seconds, slot_name=slot_name)
    slot = wait_for_slot(engine, plan.slot.name, plan.mark, timeout=wait_seconds)
    deleted = purge_marked(
        engine, plan.mark, older_than_seconds=older_than_seconds, batch_size=batch_size
    )
    return PurgeResult(plan=plan, slot=slot, deleted=deleted)
