"""Apply a run of consumed records to one effect in one database transaction, each at most once.

The fast path inserts the receipts ``(event_id, effect)`` of the whole run with one statement,
which returns only the event ids that already had one (the duplicates: they cost no decoding
and no model). The other records' values are decoded, the handler is called for each (or once
for all, with ``batch=True``), the rows collected by ``ctx.insert`` / ``ctx.upsert`` and the
session's pending objects are written, and the transaction commits: receipts and effects commit
together or not at all. When a value cannot be decoded, a handler raises, or the writes fail,
that transaction rolls back and the run is applied again record by record, each record in a
savepoint: the failing record rolls back only its own receipt and effect and stops its
partition, the records before it commit. A handler can therefore be called again for a record
whose first attempt rolled back; its writes must go through its context (calls to the outside
world go through tasks).

An ``async`` effect runs the same steps on an ``AsyncSession``: :meth:`Applier.apply_async`
runs them in the session's greenlet (``AsyncSession.run_sync``) and awaits the handler there,
so both kinds share one implementation.

Each handler call runs inside a CONSUMER span whose parent is the record's trace context
(:meth:`~oncely.runtime.tracing.Tracing.process`), so a task it enqueues continues the trace.

Only the receipt's primary key means "already applied"; any other error is the
record's failure, and so is a plain handler that returns an awaitable: the awaitable is closed
unrun, the record fails with an :class:`~oncely.consumers.effects.EffectDeclarationError`, and
its receipt rolls back. Errors of the database itself (a lost connection, a failed commit) are
reported for the whole run, which is then not applied at all.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from confluent_kafka import Message
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util import await_

from oncely.consumers.effects import (
    Effect,
    EffectContext,
    EffectDeclarationError,
    EffectTransaction,
    handler_name,
)
from oncely.consumers.records import (
    Decoded,
    Envelope,
    Undecodable,
    decode_event,
    decode_events,
)
from oncely.consumers.writes import Writes
from oncely.failpoints import failpoint
from oncely.runtime.metrics import ConsumerMetrics
from oncely.runtime.tracing import Tracing
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeFailure
from oncely.storage.stores import receipts

PartitionId = tuple[str, int]
Record = Envelope | Undecodable


def topic_partition(message: Message) -> PartitionId:
    return (message.topic() or "", message.partition() or 0)


@dataclass(frozen=True)
class Failure:
    """The record that stopped its partition, and why."""

    message: Message
    error: BaseException | str
    kind: Literal["handler", "undecodable", "database"]
    decode_failure: DecodeFailure | None = None

    @property
    def offset(self) -> int:
        return self.message.offset() or 0

    @property
    def partition_id(self) -> PartitionId:
        """The record's ``(topic, partition)``."""
        return topic_partition(self.message)


@dataclass
class BatchResult:
    """What one transaction did: per partition, the offset after the last record done."""

    done: dict[PartitionId, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    applied: int = 0
    duplicates: int = 0


class _FallBack(Exception):
    """A value, a handler or the writes failed on the fast path."""


class Applier:
    """Applies runs of records to ``effect`` through receipts, in transactions on ``engine``
    (or on ``async_engine`` for an ``async`` effect)."""

    def __init__(
        self,
        effect: Effect,
        engine: sa.Engine,
        metrics: ConsumerMetrics,
        codec: Codec,
        async_engine: AsyncEngine | None = None,
        *,
        group_id: str = "",
        tracing: Tracing | None = None,
    ) -> None:
        """``group_id`` (the effect's consumer group) and ``tracing`` (default: the global
        tracer provider) describe the handler's spans."""
        self.effect = effect
        self.engine = engine
        self.async_engine = async_engine
        self.metrics = metrics
        self.codec = codec
        self.group_id = group_id
        self.tracing = tracing or Tracing()

    def apply(self, records: Sequence[Record]) -> BatchResult:
        """Apply ``records`` (in Kafka order per partition) once each; never raises.

        A partition stops at its first record that cannot be applied (undecodable, failing
        handler, database error): later records of that partition in ``records`` are left
        undone, so neither a key's order nor the committed offset passes the failure.
        """
        try:
            try:
                with Session(self.engine) as session, session.begin():
                    return self._apply_run(session, records, session)
            except _FallBack:
                with Session(self.engine) as session, session.begin():
                    return self._apply_each(session, records, session)
        except sa.exc.DBAPIError as exc:
            return _database_failure(records, exc)

    def apply_in(self, session: Session, records: Sequence[Record]) -> BatchResult:
        """Apply ``records`` inside ``session``'s transaction, in a savepoint, as :meth:`apply`
        does in its own transaction (a sync effect only). A handler's or a write's error is
        raised as is (the savepoint rolled back); a record that cannot be decoded raises
        ``ValueError`` naming why."""
        for record in records:
            if isinstance(record, Undecodable):
                raise ValueError(f"the record cannot be applied: {record.reason}")
        try:
            with session.begin_nested():
                return self._apply_run(session, records, session)
        except _FallBack as fallback:
            if fallback.__cause__ is not None:
                raise fallback.__cause__ from None
            raise ValueError(f"the record cannot be applied: {fallback}") from None

    async def apply_in_async(self, session: AsyncSession, records: Sequence[Record]) -> BatchResult:
        """:meth:`apply_in` for an ``async`` effect, inside ``session``'s transaction."""
        for record in records:
            if isinstance(record, Undecodable):
                raise ValueError(f"the record cannot be applied: {record.reason}")
        try:
            async with session.begin_nested():
                return await session.run_sync(self._apply_run, records, session)
        except _FallBack as fallback:
            if fallback.__cause__ is not None:
                raise fallback.__cause__ from None
            raise ValueError(f"the record cannot be applied: {fallback}") from None

    async def apply_async(self, records: Sequence[Record]) -> BatchResult:
        """:meth:`apply` for an ``async`` effect, on ``async_engine``; never raises."""
        assert self.async_engine is not None, "an async effect's Applier has an async engine"
        try:
            try:
                async with AsyncSession(self.async_engine) as session, session.begin():
                    return await session.run_sync(self._apply_run, records, session)
            except _FallBack:
                async with AsyncSession(self.async_engine) as session, session.begin():
                    return await session.run_sync(self._apply_each, records, session)
        except sa.exc.DBAPIError as exc:
            return _database_failure(records, exc)

    def _apply_run(
        self, session: Session, records: Sequence[Record], handed: Session | AsyncSession
    ) -> BatchResult:
        outcome = BatchResult()
        envelopes: list[Envelope] = []
        topics: list[str] = []
        partitions: list[int] = []
        offsets: list[int] = []
        stopped: set[PartitionId] = set()
        done = outcome.done
        for record in records:
            message = record.message
            tp = (message.topic() or "", message.partition() or 0)
            if stopped and tp in stopped:
                continue
            if isinstance(record, Undecodable):
                outcome.failures.append(_undecodable(record))
                stopped.add(tp)
                continue
            offset = message.offset() or 0
            envelopes.append(record)
            topics.append(tp[0])
            partitions.append(tp[1])
            offsets.append(offset)
            done[tp] = offset + 1
        if not envelopes:
            return outcome
        duplicates = receipts.insert_receipts(
            session,
            effect=self.effect.name,
            event_ids=[envelope.event_id_text for envelope in envelopes],
            topics=topics,
            partitions=partitions,
            offsets=offsets,
        )
        fresh: list[Envelope] = []
        seen: set[str] = set()
        for envelope in envelopes:
            event_id = envelope.event_id_text
            if event_id in duplicates or event_id in seen:
                outcome.duplicates += 1  # a second copy in the same run is a duplicate too
            else:
                seen.add(event_id)
                fresh.append(envelope)
        if fresh:
            new = decode_events(fresh, codec=self.codec)
            if new is None:
                raise _FallBack("a value cannot be decoded")
            writes = Writes()
            try:
                self._call_handler(new, handed, writes)
                writes.write(session)
                session.flush()
            except Exception as exc:
                raise _FallBack from exc
        outcome.applied = len(fresh)
        failpoint("consumer.after_effect_before_db_commit")
        return outcome

    def _apply_each(
        self, session: Session, records: Sequence[Record], handed: Session | AsyncSession
    ) -> BatchResult:
        outcome = BatchResult()
        stopped: set[PartitionId] = set()
        for record in records:
            message = record.message
            tp = topic_partition(message)
            if tp in stopped:
                continue
            applied = self._apply_one(session, record, handed)
            if isinstance(applied, Failure):
                outcome.failures.append(applied)
                stopped.add(tp)
            else:
                outcome.done[tp] = (message.offset() or 0) + 1
                if applied:
                    outcome.applied += 1
                else:
                    outcome.duplicates += 1
        failpoint("consumer.after_effect_before_db_commit")
        return outcome

    def _apply_one(
        self, session: Session, record: Record, handed: Session | AsyncSession
    ) -> bool | Failure:
        """Apply ``record`` in a savepoint of its own: ``True`` when it was new, ``False`` when
        its receipt was there already, else why it failed (its savepoint rolled back)."""
        if isinstance(record, Undecodable):
            return _undecodable(record)
        message = record.message
        savepoint = session.begin_nested()
        try:
            new = receipts.insert_receipt(
                session,
                effect=self.effect.name,
                event_id=record.event_id,
                topic=message.topic(),
                partition=message.partition(),
                offset=message.offset(),
            )
            decoded = decode_event(record, codec=self.codec) if new else None
            if isinstance(decoded, Decoded):
                writes = Writes()
                self._call_handler([decoded], handed, writes)
                writes.write(session)
                session.flush()  # integrity errors surface here, inside the record's savepoint
        except Exception as exc:  # the failure policy decides, nothing is swallowed
            savepoint.rollback()
            return Failure(message, exc, "handler")
        if isinstance(decoded, Undecodable):
            savepoint.rollback()
            return _undecodable(decoded)
        savepoint.commit()
        return new

    def _call_handler(
        self, records: Sequence[Decoded], session: Session | AsyncSession, writes: Writes
    ) -> None:
        handler: Callable[..., Any] = self.effect.handler
        tracing = self.tracing.enabled
        transaction: EffectTransaction[Any] = EffectTransaction(
            session,
            self.effect.name,
            writes,
            self.codec,
            in_record_span=tracing and not self.effect.batch,
        )
        pairs = [(record.event, EffectContext(record.envelope, transaction)) for record in records]
        started = time.perf_counter()
        if self.effect.batch:
            with self.tracing.process_batch(
                topics=[r.envelope.message.topic() or "" for r in records],
                group=self.group_id,
                effect=self.effect.name,
                headers=[r.envelope.headers for r in records],
            ):
                self._finish(handler(pairs))
        elif not tracing:
            for event, context in pairs:
                result = handler(event, context)
                if result is not None:
                    self._finish(result)
        else:
            for (event, context), record in zip(pairs, records, strict=True):
                message = record.envelope.message
                with self.tracing.process(
                    topic=message.topic() or "",
                    partition=message.partition() or 0,
                    offset=message.offset() or 0,
                    event_id=record.envelope.event_id_text,
                    group=self.group_id,
                    effect=self.effect.name,
                    headers=record.envelope.headers,
                ):
                    self._finish(handler(event, context))
        self.metrics.handler_latency.labels(self.effect.name).observe(time.perf_counter() - started)

    def _finish(self, result: object) -> None:
        """Await an async handler's coroutine (in the session's greenlet); refuse an awaitable
        from a plain handler, which would otherwise never run."""
        if not inspect.isawaitable(result):
            return
        if self.async_engine is not None:
            await_(result)
            return
        close = getattr(result, "close", None)
        if callable(close):
            close()  # never run: no "coroutine was never awaited" warning either
        raise EffectDeclarationError(
            f"effect {self.effect.name!r}: handler {handler_name(self.effect.handler)} is not "
            f"declared async but returned an awaitable ({type(result).__name__}), which would "
            "never run; declare it with `async def`"
        )


def _undecodable(record: Undecodable) -> Failure:
    return Failure(record.message, record.reason, "undecodable", record.failure)


def _database_failure(records: Sequence[Record], exc: sa.exc.DBAPIError) -> BatchResult:
    firsts: dict[PartitionId, Message] = {}
    for record in records:
        firsts.setdefault(topic_partition(record.message), record.message)
    return BatchResult(failures=[Failure(m, exc, "database") for m in firsts.values()])
