"""Apply a run of consumed records to one effect in one database transaction, each at most once.

The fast path inserts the receipts ``(event_id, effect)`` of the whole run with one statement
(``ON CONFLICT DO NOTHING RETURNING``), calls the handler only for the records whose receipt is
new, flushes their writes together and commits: receipts and effects commit together or not at
all. When a handler raises, or the flush of the handlers' writes fails, that transaction rolls
back and the run is applied again record by record, each record in a savepoint: the failing
record rolls back only its own receipt and effect and stops its partition, the records before
it commit. A handler can therefore be called again for a record whose first attempt rolled back;
its writes must go through ``ctx.session`` (calls to the outside world go through tasks).

Only the receipt's primary key means "already applied" (seed 004); any other error is the
record's failure, and so is a handler that returns an awaitable (an ``async`` handler slipped
past the declaration check): the awaitable is closed unrun, the record fails with an
:class:`~oncely.consumers.effects.EffectDeclarationError`, and its receipt rolls back. Errors
of the database itself (a lost connection, a failed commit) are reported for the whole run,
which is then not applied at all.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import Message
from sqlalchemy.orm import Session

from oncely.consumers.effects import (
    Effect,
    EffectContext,
    EffectDeclarationError,
    async_handler_message,
)
from oncely.consumers.records import Decoded, Undecodable
from oncely.ops.failpoints import failpoint
from oncely.ops.metrics import ConsumerMetrics
from oncely.schemas.errors import DecodeFailure
from oncely.storage.queries import query

PartitionId = tuple[str, int]
Record = Decoded | Undecodable


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


@dataclass
class Outcome:
    """What one transaction did: per partition, the offset after the last record done."""

    done: dict[PartitionId, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    applied: int = 0
    duplicates: int = 0


class _FallBack(Exception):
    """A handler or the flush of its writes failed on the fast path."""


class Applier:
    """Applies runs of records to ``effect`` through receipts, in transactions on ``engine``."""

    def __init__(self, effect: Effect, engine: sa.Engine, metrics: ConsumerMetrics) -> None:
        self.effect = effect
        self.engine = engine
        self.metrics = metrics

    def apply(self, records: Sequence[Record]) -> Outcome:
        """Apply ``records`` (in Kafka order per partition) once each; never raises.

        A partition stops at its first record that cannot be applied (undecodable, failing
        handler, database error): later records of that partition in ``records`` are left
        undone, so neither a key's order nor the committed offset passes the failure.
        """
        try:
            try:
                return self._apply_run(records)
            except _FallBack:
                return self._apply_each(records)
        except sa.exc.DBAPIError as exc:
            firsts: dict[PartitionId, Message] = {}
            for record in records:
                firsts.setdefault(topic_partition(record.message), record.message)
            return Outcome(failures=[Failure(m, exc, "database") for m in firsts.values()])

    def _apply_run(self, records: Sequence[Record]) -> Outcome:
        outcome = Outcome()
        eligible: list[Decoded] = []
        stopped: set[PartitionId] = set()
        for record in records:
            tp = topic_partition(record.message)
            if tp in stopped:
                continue
            if isinstance(record, Undecodable):
                outcome.failures.append(
                    Failure(record.message, record.reason, "undecodable", record.failure)
                )
                stopped.add(tp)
            else:
                eligible.append(record)
        if not eligible:
            return outcome
        with Session(self.engine) as session, session.begin():
            new = self._insert_receipts(session, eligible)
            for record in eligible:
                if record.event_id in new:
                    new.discard(record.event_id)  # a second copy in the same run is a duplicate
                    try:
                        self._call_handler(session, record)
                    except Exception as exc:
                        raise _FallBack from exc
                    outcome.applied += 1
                else:
                    outcome.duplicates += 1
                outcome.done[topic_partition(record.message)] = (record.message.offset() or 0) + 1
            try:
                session.flush()
            except Exception as exc:
                raise _FallBack from exc
            failpoint("consumer.after_effect_before_db_commit")
        return outcome

    def _insert_receipts(self, session: Session, records: Sequence[Decoded]) -> set[UUID]:
        rows = session.execute(
            query("receipts_insert_many"),
            {
                "effect": self.effect.name,
                "event_ids": [r.event_id for r in records],
                "topics": [r.message.topic() for r in records],
                "partitions": [r.message.partition() for r in records],
                "offsets": [r.message.offset() for r in records],
            },
        )
        return {row.event_id for row in rows}

    def _apply_each(self, records: Sequence[Record]) -> Outcome:
        outcome = Outcome()
        stopped: set[PartitionId] = set()
        with Session(self.engine) as session, session.begin():
            for record in records:
                message = record.message
                tp = topic_partition(message)
                if tp in stopped:
                    continue
                if isinstance(record, Undecodable):
                    outcome.failures.append(
                        Failure(message, record.reason, "undecodable", record.failure)
                    )
                    stopped.add(tp)
                    continue
                savepoint = session.begin_nested()
                try:
                    applied = self._apply_one(session, record)
                    savepoint.commit()
                except Exception as exc:  # the failure policy decides, nothing is swallowed
                    savepoint.rollback()
                    outcome.failures.append(Failure(message, exc, "handler"))
                    stopped.add(tp)
                    continue
                outcome.done[tp] = (message.offset() or 0) + 1
                if applied:
                    outcome.applied += 1
                else:
                    outcome.duplicates += 1
            failpoint("consumer.after_effect_before_db_commit")
        return outcome

    def _apply_one(self, session: Session, record: Decoded) -> bool:
        message = record.message
        inserted = session.execute(
            query("receipt_insert"),
            {
                "event_id": record.event_id,
                "effect": self.effect.name,
                "topic": message.topic(),
                "partition": message.partition(),
                "offset": message.offset(),
            },
        ).first()
        if inserted is None:
            return False
        self._call_handler(session, record)
        session.flush()  # integrity errors surface here, inside the record's savepoint
        return True

    def _call_handler(self, session: Session, record: Decoded) -> None:
        message = record.message
        context = EffectContext(
            session=session,
            effect=self.effect.name,
            event_id=record.event_id,
            event_type=record.event_type.name,
            topic=message.topic() or "",
            partition=message.partition() or 0,
            offset=message.offset() or 0,
            headers=record.headers,
        )
        started = time.perf_counter()
        handler: Callable[..., object] = self.effect.handler
        result = handler(record.event, context)
        if inspect.isawaitable(result):
            close = getattr(result, "close", None)
            if callable(close):
                close()  # never run: no "coroutine was never awaited" warning either
            raise EffectDeclarationError(
                async_handler_message(
                    self.effect.name, self.effect.handler, returned=type(result).__name__
                )
            )
        self.metrics.handler_latency.labels(self.effect.name).observe(time.perf_counter() - started)
