"""Effect apps: one consumer group per effect, each applying events once through receipts.

::

    effects = oncely.Effects(registry)

    @effects.effect("send-receipt", on=TransferCompleted)
    def send_receipt(event: TransferCompleted, ctx: oncely.EffectContext) -> None:
        ctx.insert(Notification, {"transfer_id": event.transfer_id})  # same transaction

A handler runs inside the database transaction that inserts its receipt ``(event_id,
effect)``; both commit together or neither does, and the Kafka offset is committed only after.
A redelivered event finds its receipt and the handler is not called again.

A handler writes through its context: ``ctx.insert`` / ``ctx.upsert`` collect rows that are
written once per batch (no ORM object per record), and ``ctx.session`` is the transaction's
session for anything else (``ctx.session.add(...)``, queries). ``ctx.stage`` stages a follow-up
event in the same transaction. A handler declared with
``batch=True`` gets the batch's new events at once, as ``(event, ctx)`` pairs. An ``async def``
handler runs on an asyncio event loop, and its ``ctx.session`` is an ``AsyncSession`` on the
same transaction; sync and async effects can share a process.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, overload
from uuid import UUID

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from typing_extensions import TypeVar

from oncely.consumers.records import Envelope
from oncely.consumers.writes import TableLike, Writes
from oncely.errors import ConfigurationError
from oncely.events import EventType, Registry, registry_of
from oncely.producer.staging import outbox_rows, staged_event
from oncely.runtime.retry import Backoff
from oncely.runtime.tracing import current_context_text, record_context_text
from oncely.schemas.codec import Codec
from oncely.storage.stores.outbox.writes import StagedEvent
from oncely.tasks.enqueue import enqueue_task
from oncely.tasks.model import QueuedTask
from oncely.wire import CAUSATION_HEADER, dlq_topic

_EFFECT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,99}")


class EffectDeclarationError(ConfigurationError):
    """The effect is declared wrongly."""


def is_async_callable(handler: object) -> bool:
    """Whether calling ``handler`` returns a coroutine: an ``async def`` function or method, a
    ``functools.partial`` of one, or an object whose ``__call__`` is ``async def``."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    if inspect.iscoroutinefunction(handler):
        return True
    if inspect.isfunction(handler) or inspect.ismethod(handler) or isinstance(handler, type):
        return False
    return inspect.iscoroutinefunction(inspect.getattr_static(type(handler), "__call__", None))


def handler_name(handler: object) -> str:
    """``module.qualname`` of a handler, for error messages."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    module = getattr(handler, "__module__", None) or type(handler).__module__
    return f"{module}.{name}"


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """What happens when a handler raises (or an integrity error other than the receipt's).

    The record is retried in place ``max_attempts`` times, ``backoff_seconds`` doubling from
    ``initial_backoff_seconds``; then ``then`` decides: ``"dead_letter"`` produces the original
    record to ``<topic>.<effect>.dlq`` and moves on, ``"block"`` stops the partition (strict
    order) until the process restarts. The offset never passes a record that was not applied or
    dead-lettered.
    """

    max_attempts: int = 5
    initial_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    then: Literal["dead_letter", "block"] = "dead_letter"

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retrying after failed attempt ``attempt``."""
        return Backoff(first=self.initial_backoff_seconds, maximum=self.max_backoff_seconds).delay(
            attempt
        )


S = TypeVar("S", Session, AsyncSession, default=Session)


@dataclass(frozen=True, slots=True)
class EffectTransaction(Generic[S]):
    """What the contexts of one transaction share: the session handed to the handler, the
    rows collected for the batch, and how a follow-up event is encoded and traced."""

    session: S
    effect: str
    writes: Writes
    codec: Codec
    in_record_span: bool
    """The handler runs in its record's own span: a follow-up continues the active context
    (else the record's)."""


class EffectContext(Generic[S]):
    """What a handler knows about the record it applies, and the transaction to apply it in.

    ``session`` is a ``Session`` for a plain handler and an ``AsyncSession`` for an ``async``
    one (annotate it ``EffectContext[AsyncSession]``, or :data:`AsyncEffectContext`).
    """

    __slots__ = ("_envelope", "_transaction")

    def __init__(self, envelope: Envelope, transaction: EffectTransaction[S]) -> None:
        self._envelope = envelope
        self._transaction: EffectTransaction[S] = transaction

    def __repr__(self) -> str:
        return f"EffectContext(effect={self.effect!r}, event_id={self._envelope.event_id_text})"

    @property
    def session(self) -> S:
        """The transaction's session (the receipt's transaction)."""
        return self._transaction.session

    @property
    def effect(self) -> str:
        return self._transaction.effect

    @property
    def envelope(self) -> Envelope:
        """The record being applied, its value not decoded."""
        return self._envelope

    @property
    def event_id(self) -> UUID:
        return self._envelope.event_id

    @property
    def event_type(self) -> str:
        return self._envelope.event_type.name

    @property
    def topic(self) -> str:
        return self._envelope.message.topic() or ""

    @property
    def partition(self) -> int:
        return self._envelope.message.partition() or 0

    @property
    def offset(self) -> int:
        return self._envelope.message.offset() or 0

    @property
    def headers(self) -> Mapping[str, str]:
        return self._envelope.headers

    def insert(self, table: TableLike, values: Mapping[str, Any]) -> None:
        """Insert a row into ``table`` (a ``Table`` or a mapped class) in this transaction.

        The row is written with the batch's other rows of the same table and columns in one
        multi-row statement just before the commit, so a constraint it breaks (a missing
        foreign key) fails at the end of the batch: the consumer then applies the batch record
        by record and this record fails alone (its receipt rolls back with it). Rows are
        written per statement in the order each was first used (insert parents before
        children in the same batch by inserting them first). ``values`` are keyed by column
        name. Raises :class:`~oncely.consumers.writes.WriteError` for an unknown column.
        """
        self._transaction.writes.insert(table, values)

    def upsert(
        self,
        table: TableLike,
        values: Mapping[str, Any],
        *,
        on: Sequence[str],
        update: Sequence[str] | None = None,
    ) -> None:
        """Insert a row, or update the one whose ``on`` columns (a unique index) match.

        ``update`` names the columns an existing row takes from ``values`` (default: every
        column not in ``on``; empty: ``DO NOTHING``). Written like :meth:`insert`; upserts of
        one key in one batch are merged in order first, as if each had run on its own.
        """
        self._transaction.writes.upsert(table, values, on=on, update=update)

    def stage(
        self,
        event: BaseModel,
        *,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        available_at: datetime | None = None,
    ) -> StagedEvent:
        """Stage a follow-up event in this effect's transaction, as ``oncely.stage`` would.

        It commits with the receipt and the effect's rows or not at all, so a redelivered
        record, which finds its receipt, never stages it twice. The follow-ups of a batch are
        added to the outbox in one ``INSERT`` just before the commit. Each carries the header
        ``causationId`` (the id of this event) and the trace context: the handler's span when
        it runs in one of its own, else the context this record arrived with.

        Raises what ``oncely.stage`` raises when it encodes the event (an unregistered model,
        an event that does not fit its schema or the stage limits), here in the handler; a
        repeated ``idempotency_key`` fails the write of the batch, and then this record alone
        with :class:`~oncely.storage.DuplicateEventError`.
        """
        transaction = self._transaction
        envelope = self._envelope
        codec: Codec | None = transaction.codec
        if registry_of(type(event)) is not transaction.codec.registry:
            codec = None  # a model of another registry: that registry's default codec
        trace = (
            current_context_text()
            if transaction.in_record_span
            else record_context_text(envelope.headers)
        )
        [row] = outbox_rows(
            [event],
            codec=codec,
            idempotency_keys=[idempotency_key],
            headers={**(headers or {}), CAUSATION_HEADER: envelope.event_id_text},
            available_at=available_at,
            trace_context=trace,
        )
        transaction.writes.stage(row)
        return staged_event(row)

    def enqueue_task(
        self,
        name: str,
        payload: Mapping[str, Any],
        *,
        policy: Literal["retry_safe", "irreversible"] = "retry_safe",
        task_key: str | None = None,
        ttl: timedelta | None = None,
        max_attempts: int | None = None,
        available_at: datetime | timedelta | None = None,
    ) -> QueuedTask:
        """Queue a local task (an email, a webhook) in this effect's transaction.

        The default ``task_key`` is ``<effect>:<event id>:<name>``, so a redelivered event can
        never queue it twice; the task worker delivers it with that stable idempotency key.
        """
        return enqueue_task(
            self.session,
            name,
            payload,
            policy=policy,
            task_key=task_key or f"{self.effect}:{self.event_id}:{name}",
            ttl=ttl,
            max_attempts=max_attempts,
            available_at=available_at,
        )


AsyncEffectContext = EffectContext[AsyncSession]
"""The context of an ``async def`` handler: its ``session`` is an ``AsyncSession``."""

#: ``handler(event, ctx)``, or with ``batch=True`` ``handler([(event, ctx), ...])``; sync or async.
EffectHandler = Callable[..., Any]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

#: An effect's handler for events of model ``M`` (returning ``R``, or a coroutine when async).
EventHandler = Callable[[M, EffectContext[Any]], R]
#: A ``batch=True`` handler: the batch's new events of model ``M`` with their contexts.
BatchHandler = Callable[[list[tuple[M, EffectContext[Any]]]], R]


@dataclass(frozen=True)
class Effect:
    """One declared effect: its name (and consumer group), event types, handler and policy."""

    name: str
    event_types: tuple[EventType[Any], ...]
    handler: EffectHandler
    failure: FailurePolicy = field(default_factory=FailurePolicy)
    batch: bool = False
    """The handler takes the batch's new events at once, as ``(event, ctx)`` pairs."""

    @property
    def is_async(self) -> bool:
        """The handler is ``async`` (see :func:`is_async_callable`): it runs on an event loop."""
        return is_async_callable(self.handler)

    @property
    def topics(self) -> list[str]:
        return sorted({t.topic for t in self.event_types})

    def dlq_topic(self, topic: str) -> str:
        return dlq_topic(topic, self.name)


class Effects:
    """The effects of an application, over the event types of one :class:`Registry`."""

    def __init__(self, registry: Registry, *, group_prefix: str = "") -> None:
        self.registry = registry
        self.group_prefix = group_prefix
        self._effects: dict[str, Effect] = {}

    @overload
    def effect(
        self,
        name: str,
        *,
        on: type[M],
        failure: FailurePolicy | None = None,
        batch: Literal[False] = False,
    ) -> Callable[[EventHandler[M, R]], EventHandler[M, R]]: ...

    @overload
    def effect(
        self,
        name: str,
        *,
        on: type[M],
        failure: FailurePolicy | None = None,
        batch: Literal[True],
    ) -> Callable[[BatchHandler[M, R]], BatchHandler[M, R]]: ...

    @overload
    def effect(
        self,
        name: str,
        *,
        on: type[BaseModel] | Sequence[type[BaseModel]],
        failure: FailurePolicy | None = None,
        batch: bool = False,
    ) -> Callable[[EffectHandler], EffectHandler]: ...

    def effect(
        self,
        name: str,
        *,
        on: type[BaseModel] | Sequence[type[BaseModel]],
        failure: FailurePolicy | None = None,
        batch: bool = False,
    ) -> Callable[[EffectHandler], EffectHandler]:
        """Declare ``name`` (its consumer group is ``group_prefix + name``) for the model ``on``,
        or each model of a sequence.

        The handler is ``handler(event, ctx)``, called once per new event; with ``batch=True``
        it is ``handler(batch)``, called once per batch with the new events as a list of
        ``(event, ctx)`` pairs in Kafka order (a batch that fails is applied again one event at
        a time, so the handler is then called with batches of one). Either can be ``async def``.
        With one model (``on=Model``, not in a list) a type checker checks the handler's event
        parameter against it.

        Raises:
            EffectDeclarationError: a bad or repeated name, or no event types.
            UnknownEventTypeError: a model in ``on`` is not in the registry.
        """
        models = (on,) if isinstance(on, type) else tuple(on)

        def declare(handler: EffectHandler) -> EffectHandler:
            if not _EFFECT_NAME.fullmatch(name):
                raise EffectDeclarationError(
                    f"effect name {name!r}: use lower-case letters, digits, '.', '_' and '-'"
                )
            if name in self._effects:
                raise EffectDeclarationError(f"effect {name!r} is declared twice")
            if not models:
                raise EffectDeclarationError(f"effect {name!r} consumes no event type")
            types = tuple(self.registry.for_model(model) for model in models)
            self._effects[name] = Effect(name, types, handler, failure or FailurePolicy(), batch)
            return handler

        return declare

    def get(self, name: str) -> Effect:
        """The effect declared as ``name``; :class:`EffectDeclarationError` naming the declared
        ones when there is none."""
        try:
            return self._effects[name]
        except KeyError:
            known = ", ".join(sorted(self._effects)) or "none"
            raise EffectDeclarationError(f"no effect {name!r} (declared: {known})") from None

    def group_id(self, name: str) -> str:
        """The consumer group of the effect ``name``: ``group_prefix`` + ``name``."""
        return self.group_prefix + self.get(name).name

    def __iter__(self) -> Iterator[Effect]:
        return iter(self._effects.values())

    def names(self) -> list[str]:
        """The declared effects' names, sorted."""
        return sorted(self._effects)
