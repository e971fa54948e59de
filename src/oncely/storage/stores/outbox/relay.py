"""The relay's only access to PostgreSQL: snapshot reads, progress, leases and parked keys.

Every method is one named statement (``storage/sql/outbox.sql``) in its own short transaction,
except :meth:`RelayStore.record`, which writes progress, parked keys and held rows together.
Writes that depend on holding a shard are fenced by the shard's lease epoch: a shard another
relay took over is reported back as lost and nothing of it changes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from oncely.failpoints import failpoint
from oncely.storage.queries import purge_in_batches, query
from oncely.storage.stores.outbox.reports import parked_by_topic
from oncely.storage.stores.outbox.rows import OutboxRow, TopicPurge
from oncely.storage.stores.outbox.snapshots import Difference, Snapshot


@dataclass(frozen=True, slots=True)
class Progress:
    """A shard's recorded position: all of ``done`` acknowledged, and of ``reading`` (when set)
    every row up to ``after_seq``."""

    done: Snapshot
    reading: Snapshot | None = None
    after_seq: int = 0

    def beyond(self, other: Progress) -> bool:
        """Whether this position is past ``other``, both of one shard (a shard moves from
        ``done`` through ``reading``'s rows by ``seq`` to ``done=reading``)."""
        return self._order() > other._order()

    def _order(self) -> tuple[tuple[int, int, int], tuple[int, int, int] | tuple[()], int]:
        return (
            self.done.order(),
            self.reading.order() if self.reading is not None else (),
            self.after_seq,
        )


@dataclass(frozen=True, slots=True)
class ShardProgress:
    """A shard leased under ``epoch`` and its position: as :meth:`RelayStore.acquire` leases it
    (its recorded progress), or a new one for :meth:`RelayStore.record` to record."""

    shard: int
    epoch: int
    progress: Progress


@dataclass(frozen=True, slots=True)
class Parking:
    """A key parked by ``event_id``: dead (with ``error``, after ``attempts`` of its own, the
    first at ``first_failed_at``), delayed (``until``), or blocked (its topic is missing or not
    authorised; ``error`` says which)."""

    topic: str
    aggregateid: str
    shard: int
    event_id: UUID
    reason: str
    error: str | None = None
    until: datetime | None = None
    request: str | None = None
    due: bool = False
    attempts: int | None = None
    first_failed_at: datetime | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.topic, self.aggregateid)


@dataclass(frozen=True, slots=True)
class Held:
    """A row read behind a parked key."""

    event_id: UUID
    topic: str
    aggregateid: str
    shard: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    alive: int
    shards: int
    kept: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class ShardBacklog:
    """Unpublished rows of one topic in one shard, and the age of the oldest."""

    topic: str
    shard: int
    unpublished: int
    oldest_unpublished_seconds: float


@dataclass(frozen=True, slots=True)
class ShardState:
    """A shard's lease (``owner`` ``None``: never leased) and how old its progress is;
    ``exactly_once``: the owner's output mode as its last heartbeat said (``None``: no owner, or
    its heartbeats are gone)."""

    shard: int
    owner: str | None
    epoch: int
    leased: bool
    progress_age_seconds: float
    exactly_once: bool | None = None


def _progress(done: str, reading: str | None, after_seq: int) -> Progress:
    return Progress(
        Snapshot.parse(done), Snapshot.parse(reading) if reading is not None else None, after_seq
    )


#: Read cursors kept open at most (one per group of shards read together).
_MAX_CURSORS = 8


@dataclass(slots=True)
class _Cursor:
    """A server-side cursor over the rest of a read: ``at`` = (done, reading, after_seq) of
    the read that continues from it."""

    name: str
    at: tuple[Snapshot, Snapshot, int] | None = None


class RelayStore:
    """The relay ``owner``'s statements over a SQLAlchemy ``Engine``."""

    def __init__(self, engine: sa.Engine, *, owner: str, exactly_once: bool = False) -> None:
        """``exactly_once``: the relay's output mode, written with each :meth:`heartbeat` (for
        ``oncely status``)."""
        self.engine = engine
        self.owner = owner
        self.exactly_once = exactly_once
        self._reader: sa.Connection | None = None
        self._statements: dict[str, str] = {}
        self._cursors: dict[tuple[int, ...], _Cursor] = {}
        self._cursor_names = itertools.count(1)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[sa.Connection]:
        """The relay's read connection: kept open, autocommit (one round trip per statement).

        A failed statement closes it; the next read reconnects.
        """
        if self._reader is None:
            self._reader = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            yield self._reader
        except sa.exc.DBAPIError:
            self.close()
            raise

    @contextlib.contextmanager
    def _progress_transaction(self) -> Iterator[sa.Connection]:
        """A write transaction whose commit does not wait for the WAL flush: losing it in a
        database crash only replays what it recorded (duplicates, never loss)."""
        with self.engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            yield conn

    def close(self) -> None:
        """Close the read connection's cursors (they outlive transactions) and give the
        connection back (the next read opens another)."""
        if self._reader is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                if self._cursors and not self._reader.invalidated:
                    self._reader.exec_driver_sql("CLOSE ALL")
                self._reader.close()
            self._reader = None
        self._cursors.clear()

    # -- reads ---------------------------------------------------------------------------------

    def snapshot(self) -> tuple[Snapshot, datetime]:
        """The current snapshot and the database clock."""
        ((snapshot, now),) = self._fetch("relay_snapshot", {})
        return Snapshot.parse(snapshot), now

    def read(
        self,
        shards: Sequence[int],
        *,
        done: Snapshot,
        reading: Snapshot,
        after_seq: int,
        page_size: int,
    ) -> list[OutboxRow]:
        """Up to ``page_size`` rows of ``shards`` new in ``reading`` after ``after_seq``.

        A read that fills its page leaves a cursor over the rest of the difference (sorted
        once, held by the server): the next read of the same shards at the position it
        reached fetches from it instead of scanning and sorting the difference again.
        """
        difference = Difference.between(done, reading)
        if difference.empty:
            return []
        group = tuple(shards)
        held = self._cursors.pop(group, None)
        if held is not None and held.at == (done, reading, after_seq):
            rows = self._execute(f"FETCH FORWARD {int(page_size)} FROM {held.name}", {})
        else:
            if held is not None:
                self._close_cursor(held)
            params = {
                "shards": list(shards),
                "after_seq": after_seq,
                "page_size": page_size,
                **difference.params(),
            }
            statement = self._statement("relay_read")
            rows = self._execute(statement, params)
            if len(rows) == page_size:
                held = _Cursor(f"oncely_relay_read_{next(self._cursor_names)}")
                self._execute(
                    f"DECLARE {held.name} NO SCROLL CURSOR WITH HOLD FOR {statement}",
                    {**params, "after_seq": rows[-1][1], "page_size": None},
                )
        if held is not None:
            if len(rows) < page_size:
                self._close_cursor(held)
            else:
                held.at = (done, reading, rows[-1][1])
                self._cursors[group] = held
                while len(self._cursors) > _MAX_CURSORS:
                    self._close_cursor(self._cursors.pop(next(iter(self._cursors))))
        return [OutboxRow.of(row) for row in rows]

    def rows(self, ids: Sequence[UUID]) -> dict[UUID, OutboxRow]:
        """The outbox rows with these ids, from the outbox or, once retention dropped their
        partition, from its kept copies (rows purged since are missing)."""
        rows = self._fetch("relay_rows", {"ids": list(ids)})
        return {row.id: row for row in map(OutboxRow.of, rows)}

    def _close_cursor(self, cursor: _Cursor) -> None:
        self._execute(f"CLOSE {cursor.name}", {})

    def _statement(self, name: str) -> str:
        statement = self._statements.get(name)
        if statement is None:
            statement = self._statements[name] = str(
                query(name).compile(dialect=self.engine.dialect)
            )
        return statement

    def _fetch(self, name: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        """A named statement's rows as the driver returns them (tuples), on the read connection."""
        return self._execute(self._statement(name), params)

    def _execute(self, statement: str, params: dict[str, Any]) -> list[Sequence[Any]]:
        """Run ``statement`` on the read connection; its rows as the driver's tuples.

        The relay's reads skip SQLAlchemy's per-row result handling; a driver error is raised
        as SQLAlchemy's :class:`~sqlalchemy.exc.DBAPIError`, like every other statement's.
        """
        dbapi_error = self.engine.dialect.loaded_dbapi.Error
        with self._reading() as conn:
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cursor.execute(statement, params)
                return list(cursor.fetchall()) if cursor.description is not None else []
            except dbapi_error as exc:
                conn.invalidate(exc)
                raise sa.exc.DBAPIError.instance(statement, params, exc, dbapi_error) from exc
            finally:
                with contextlib.suppress(dbapi_error):
                    cursor.close()

    def parked(self, shards: Sequence[int]) -> list[Parking]:
        with self._reading() as conn:
            rows = conn.execute(query("relay_parked"), {"shards": list(shards)}).all()
        return [
            Parking(
                r.topic,
                r.aggregateid,
                r.shard,
                r.event_id,
                r.reason,
                r.error,
                r.until,
                r.request,
                bool(r.due),
            )
            for r in rows
        ]

    def held_of(self, key: tuple[str, str]) -> list[tuple[int, UUID]]:
        """``(position, event_id)`` of the rows held behind a parked key, in order."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                query("relay_held_of"), {"topic": key[0], "aggregateid": key[1]}
            ).all()
        return [(r.position, r.event_id) for r in rows]

    # -- progress ------------------------------------------------------------------------------

    def record(
        self,
        progress: Sequence[ShardProgress],
        *,
        parked: Sequence[tuple[Parking, int]] = (),
        held: Sequence[Held] = (),
    ) -> set[int]:
        """Record shards' progress with the keys parked and rows held by the same pages.

        ``parked`` pairs each parking with its shard's epoch. Returns the shards recorded; a
        shard missing from the result was taken over, and if any is missing nothing at all is
        written (call again without it).
        """
        if not progress:
            return set()
        with self._progress_transaction() as conn:
            recorded = set(
                conn.execute(
                    query("relay_record"),
                    {
                        "owner": self.owner,
                        "shards": [p.shard for p in progress],
                        "epochs": [p.epoch for p in progress],
                        "dones": [str(p.progress.done) for p in progress],
                        "readings": [
                            str(p.progress.reading) if p.progress.reading else None
                            for p in progress
                        ],
                        "afters": [p.progress.after_seq for p in progress],
                    },
                ).scalars()
            )
            if len(recorded) < len({p.shard for p in progress}):
                conn.rollback()
                return recorded
            if parked:
                self._park(conn, parked)
            if held:
                conn.execute(
                    query("relay_hold"),
                    {
                        "event_ids": [h.event_id for h in held],
                        "topics": [h.topic for h in held],
                        "keys": [h.aggregateid for h in held],
                    },
                )
            failpoint("relay.after_record_before_commit")
        return recorded

    def park(self, parked: Sequence[tuple[Parking, int]]) -> None:
        """Park keys at once (a row that failed for good), fenced by each shard's epoch."""
        with self.engine.begin() as conn:
            self._park(conn, parked)

    def _park(self, conn: sa.Connection, parked: Sequence[tuple[Parking, int]]) -> None:
        conn.execute(
            query("relay_park"),
            {
                "owner": self.owner,
                "topics": [p.topic for p, _ in parked],
                "keys": [p.aggregateid for p, _ in parked],
                "shards": [p.shard for p, _ in parked],
                "event_ids": [p.event_id for p, _ in parked],
                "reasons": [p.reason for p, _ in parked],
                "errors": [p.error for p, _ in parked],
                "untils": [p.until for p, _ in parked],
                "attempts": [p.attempts for p, _ in parked],
                "firsts": [p.first_failed_at for p, _ in parked],
                "epochs": [epoch for _, epoch in parked],
            },
        )

    def unpark(self, parking: Parking, *, epoch: int, published_to: int | None) -> bool:
        """Drop the held rows up to position ``published_to``, then the key if none is left,
        and the kept copies (``oncely_relay_kept``) of the key's rows neither parked nor held
        any more, in one transaction. A released key whose ``request`` was ``skip`` records its
        own row as skipped (``oncely_relay_skipped``): it is expected of no effect.

        Returns whether the key is released (fenced: ``False`` also when the shard was lost,
        and then nothing changes).
        """
        params = {
            "owner": self.owner,
            "topic": parking.topic,
            "aggregateid": parking.aggregateid,
            "shard": parking.shard,
            "epoch": epoch,
        }
        with self.engine.begin() as conn:
            if published_to is not None:
                conn.execute(query("relay_unhold"), {**params, "position": published_to})
            released = conn.execute(query("relay_unpark"), params).first() is not None
            if released and parking.request == "skip":
                conn.execute(query("relay_skipped"), {**params, "event_id": parking.event_id})
            conn.execute(query("relay_unkeep"), params)
            return released

    def park_failed(self, parking: Parking, *, error: str) -> None:
        """A released key's own row failed again: keep it parked as dead with ``error``."""
        with self.engine.begin() as conn:
            conn.execute(
                query("relay_park_failed"),
                {"topic": parking.topic, "aggregateid": parking.aggregateid, "error": error},
            )

    # -- membership and leases -----------------------------------------------------------------

    def heartbeat(
        self, *, ttl_seconds: float, asleep: bool, leases: Sequence[tuple[int, int]] = ()
    ) -> Heartbeat:
        """Mark this relay alive for ``ttl_seconds`` (asleep or not, in its mode) and extend its
        ``(shard, epoch)`` leases as long; :attr:`Heartbeat.kept`: the shards still held.
        One statement on the read connection (autocommit: no BEGIN and COMMIT around it)."""
        ((alive, shards, kept),) = self._fetch(
            "relay_heartbeat",
            {
                "relay_id": self.owner,
                "ttl_seconds": ttl_seconds,
                "asleep": asleep,
                "exactly_once": self.exactly_once,
                "shards": [s for s, _ in leases],
                "epochs": [e for _, e in leases],
            },
        )
        return Heartbeat(int(alive), int(shards), frozenset(kept))

    def sleep(self, *, asleep: bool) -> None:
        """Ask staging to NOTIFY this relay (``asleep``) or stop asking, committed on return."""
        self._fetch("relay_sleep", {"relay_id": self.owner, "asleep": asleep})

    def leave(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(query("relay_leave"), {"relay_id": self.owner})

    def acquire(self, *, wanted: int, lease_seconds: float) -> list[ShardProgress]:
        """Lease up to ``wanted`` free shards (epoch bumped), with their recorded progress."""
        if wanted <= 0:
            return []
        with self.engine.begin() as conn:
            rows = conn.execute(
                query("relay_acquire"),
                {"owner": self.owner, "wanted": wanted, "lease_seconds": lease_seconds},
            ).all()
        return [
            ShardProgress(r.shard, r.epoch, _progress(r.done, r.reading, r.after_seq)) for r in rows
        ]

    def release(self, leases: Sequence[tuple[int, int]]) -> set[int]:
        """Give back ``(shard, epoch)`` leases; return the shards released."""
        if not leases:
            return set()
        with self.engine.begin() as conn:
            return set(
                conn.execute(
                    query("relay_release"),
                    {
                        "owner": self.owner,
                        "shards": [s for s, _ in leases],
                        "epochs": [e for _, e in leases],
                    },
                ).scalars()
            )

    # -- operations ----------------------------------------------------------------------------

    def backlog(self) -> list[ShardBacklog]:
        """Per shard and topic: committed rows not yet acknowledged, and the oldest's age."""
        with self.engine.connect() as conn:
            return backlog(conn)

    def shards(self) -> list[ShardState]:
        with self.engine.connect() as conn:
            return shards(conn)

    def blocked_rows(self) -> dict[str, int]:
        """Per topic with blocked keys (missing or not authorised): the rows waiting for it."""
        with self.engine.connect() as conn:
            return {p.topic: p.blocked_rows for p in parked_by_topic(conn) if p.blocked}

    def purge(self, *, older_than_seconds: float, batch_size: int = 5000) -> int:
        """Delete rows older than the horizon that every read has passed, in batches."""
        params = {"older_than": older_than_seconds}
        return purge_in_batches(self.engine, "relay_purge", params, batch_size=batch_size)

    def purge_preview(self, *, older_than_seconds: float) -> list[TopicPurge]:
        """What :meth:`purge` would delete now, per topic; changes nothing."""
        with self.engine.connect() as conn:
            rows = conn.execute(query("relay_purge_preview"), {"older_than": older_than_seconds})
            return [TopicPurge(r.topic, r.rows, r.oldest_id, r.oldest_created_at) for r in rows]


def backlog(conn: sa.Connection) -> list[ShardBacklog]:
    """:meth:`RelayStore.backlog` on the caller's connection (to read it in one snapshot with
    other statements)."""
    return [
        ShardBacklog(r.topic, r.shard, int(r.unpublished), float(r.oldest_seconds))
        for r in conn.execute(query("relay_backlog"))
    ]


def shards(conn: sa.Connection) -> list[ShardState]:
    """:meth:`RelayStore.shards` on the caller's connection."""
    return [
        ShardState(
            r.shard,
            r.owner,
            r.epoch,
            bool(r.leased),
            float(r.progress_age_seconds),
            r.exactly_once,
        )
        for r in conn.execute(query("relay_shards"))
    ]
