"""Declaring effects: async handlers are refused, naming the handler and what to do instead."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from pydantic import BaseModel

import oncely
from oncely.consumers.effects import is_async_callable


class Opened(BaseModel):
    account_id: str


def effects() -> oncely.Effects:
    registry = oncely.Registry(topic_prefix="unit.")
    registry.register(Opened, name="account.opened", key="account_id", aggregate="account")
    return oncely.Effects(registry)


async def send_welcome(event: Opened, ctx: oncely.EffectContext) -> None:
    """An async handler, as a FastAPI team would write it."""


def record_welcome(event: Opened, ctx: oncely.EffectContext) -> None:
    """A plain handler."""


class AsyncCallable:
    async def __call__(self, event: Opened, ctx: oncely.EffectContext) -> None: ...


class SyncCallable:
    def __call__(self, event: Opened, ctx: oncely.EffectContext) -> None: ...


class Handlers:
    async def on_opened(self, event: Opened, ctx: oncely.EffectContext) -> None: ...

    def on_opened_sync(self, event: Opened, ctx: oncely.EffectContext) -> None: ...


async def with_option(event: Opened, ctx: oncely.EffectContext, *, loud: bool) -> None: ...


ASYNC_HANDLERS: dict[str, tuple[Any, str]] = {
    "async def": (send_welcome, "test_effect_declaration.send_welcome"),
    "async method": (Handlers().on_opened, "Handlers.on_opened"),
    "async __call__": (AsyncCallable(), "AsyncCallable"),
    "partial of async def": (functools.partial(with_option, loud=True), "with_option"),
    "partial of a partial": (
        functools.partial(functools.partial(with_option, loud=True)),
        "with_option",
    ),
}


@pytest.mark.parametrize("case", list(ASYNC_HANDLERS))
def test_an_async_handler_is_refused_at_declaration(case: str) -> None:
    handler, name = ASYNC_HANDLERS[case]
    app = effects()
    with pytest.raises(oncely.EffectDeclarationError) as caught:
        app.effect("welcome", on=[Opened])(handler)
    message = str(caught.value)
    assert "effect 'welcome'" in message
    assert name in message, "the message names the handler"
    assert "is async" in message
    assert "plain `def`" in message and "ctx.enqueue_task" in message, "it says what to do"
    assert app.names() == [], "nothing was declared"


@pytest.mark.parametrize(
    "handler",
    [record_welcome, SyncCallable(), Handlers().on_opened_sync, lambda event, ctx: None],
    ids=["def", "__call__", "method", "lambda"],
)
def test_a_sync_handler_is_declared(handler: Any) -> None:
    app = effects()
    app.effect("welcome", on=[Opened])(handler)
    assert app.get("welcome").handler is handler
    assert not is_async_callable(handler)


def test_the_error_is_public_and_an_oncely_error() -> None:
    assert issubclass(oncely.EffectDeclarationError, oncely.OncelyError)
    assert issubclass(oncely.EffectDeclarationError, oncely.ConfigurationError)
    assert "EffectDeclarationError" in oncely.__all__
