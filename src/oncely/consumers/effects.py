"""Effect apps: one consumer group per effect, each applying events once through receipts.

::

    effects = oncely.Effects(registry)

    @effects.effect("send-receipt", on=[TransferCompleted])
    def send_receipt(event: TransferCompleted, ctx: oncely.EffectContext) -> None:
        ctx.session.add(Notification(...))          # same transaction as the receipt

A handler runs inside the database transaction that inserts its receipt ``(event_id,
effect)``; both commit together or neither does, and the Kafka offset is committed only after.
A redelivered event finds its receipt and the handler is not called again.

Handlers are synchronous: an ``async def`` handler is refused when it is declared
(:class:`EffectDeclarationError`), and a handler that returns an awaitable anyway fails its
record (retried, then dead-lettered or blocking, as its failure policy says), never committing a
receipt for an effect that did not happen.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel
from sqlalchemy.orm import Session

from oncely.consumers.tasks.enqueue import enqueue_task
from oncely.consumers.tasks.model import QueuedTask
from oncely.errors import ConfigurationError
from oncely.events import EventType, Registry

_EFFECT_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,99}")


class EffectDeclarationError(ConfigurationError):
    """The effect is declared wrongly."""


def async_handler_message(effect: str, handler: object, *, returned: str | None = None) -> str:
    """What to say about ``effect``'s handler being async, or having ``returned`` an awaitable
    (the name of its type)."""
    what = "is async" if returned is None else f"returned an awaitable ({returned})"
    return (
        f"effect {effect!r}: handler {_handler_name(handler)} {what}; oncely calls handlers "
        "synchronously inside the receipt's transaction, so it would never run. "
        "Declare it with plain `def` and write through ctx.session, or queue the async call as "
        "a task with ctx.enqueue_task(...)"
    )


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


def _handler_name(handler: object) -> str:
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
        return min(self.max_backoff_seconds, self.initial_backoff_seconds * 2.0 ** (attempt - 1))


@dataclass(frozen=True, kw_only=True)
class EffectContext:
    """What a handler knows about the record it applies, and the transaction to apply it in."""

    session: Session
    effect: str
    event_id: UUID
    event_type: str
    topic: str
    partition: int
    offset: int
    headers: Mapping[str, str]

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


Handler = Callable[[Any, EffectContext], None]


@dataclass(frozen=True)
class Effect:
    """One declared effect: its name (and consumer group), event types, handler and policy."""

    name: str
    event_types: tuple[EventType[Any], ...]
    handler: Handler
    failure: FailurePolicy = field(default_factory=FailurePolicy)

    @property
    def topics(self) -> list[str]:
        return sorted({t.topic for t in self.event_types})

    def dlq_topic(self, topic: str) -> str:
        return f"{topic}.{self.name}.dlq"


class Effects:
    """The effects of an application, over the event types of one :class:`Registry`."""

    def __init__(self, registry: Registry, *, group_prefix: str = "") -> None:
        self.registry = registry
        self.group_prefix = group_prefix
        self._effects: dict[str, Effect] = {}

    def effect(
        self,
        name: str,
        *,
        on: Sequence[type[BaseModel]],
        failure: FailurePolicy | None = None,
    ) -> Callable[[Handler], Handler]:
        """Declare ``name`` (its consumer group is ``group_prefix + name``) for the models ``on``.

        Raises:
            EffectDeclarationError: a bad or repeated name, no event types, or an ``async``
                handler (see :func:`is_async_callable`): handlers are synchronous.
            UnknownEventTypeError: a model in ``on`` is not in the registry.
        """

        def declare(handler: Handler) -> Handler:
            if not _EFFECT_NAME.fullmatch(name):
                raise EffectDeclarationError(
                    f"effect name {name!r}: use lower-case letters, digits, '.', '_' and '-'"
                )
            if name in self._effects:
                raise EffectDeclarationError(f"effect {name!r} is declared twice")
            if not on:
                raise EffectDeclarationError(f"effect {name!r} consumes no event type")
            if is_async_callable(handler):
                raise EffectDeclarationError(async_handler_message(name, handler))
            types = tuple(self.registry.for_model(model) for model in on)
            self._effects[name] = Effect(name, types, handler, failure or FailurePolicy())
            return handler

        return declare

    def get(self, name: str) -> Effect:
        try:
            return self._effects[name]
        except KeyError:
            known = ", ".join(sorted(self._effects)) or "none"
            raise EffectDeclarationError(f"no effect {name!r} (declared: {known})") from None

    def group_id(self, name: str) -> str:
        return self.group_prefix + self.get(name).name

    def __iter__(self) -> Iterator[Effect]:
        return iter(self._effects.values())

    def names(self) -> list[str]:
        return sorted(self._effects)
