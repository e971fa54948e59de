"""Declaring effects: which handlers run on the event loop, and the declaration errors."""

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
def test_an_async_handler_is_declared_as_an_async_effect(case: str) -> None:
    handler, _ = ASYNC_HANDLERS[case]
    app = effects()
    app.effect("welcome", on=[Opened])(handler)
    assert app.get("welcome").is_async, "it runs on the event loop, awaited"


@pytest.mark.parametrize(
    ("name", "reason"),
    [("Welcome", "lower-case"), ("", "lower-case"), ("a b", "lower-case")],
)
def test_a_bad_effect_name_is_refused(name: str, reason: str) -> None:
    app = effects()
    with pytest.raises(oncely.EffectDeclarationError, match=reason):
        app.effect(name, on=[Opened])(record_welcome)
    assert app.names() == []


def test_an_effect_without_event_types_or_declared_twice_is_refused() -> None:
    app = effects()
    with pytest.raises(oncely.EffectDeclarationError, match="consumes no event type"):
        app.effect("welcome", on=[])(record_welcome)
    app.effect("welcome", on=[Opened])(record_welcome)
    with pytest.raises(oncely.EffectDeclarationError, match="declared twice"):
        app.effect("welcome", on=[Opened])(record_welcome)


@pytest.mark.parametrize(
    "handler",
    [record_welcome, SyncCallable(), Handlers().on_opened_sync, lambda event, ctx: None],
    ids=["def", "__call__", "method", "lambda"],
)
def test_a_sync_handler_is_declared(handler: Any) -> None:
    app = effects()
    app.effect("welcome", on=[Opened])(handler)
    assert app.get("welcome").handler is handler
    assert not is_async_callable(handler) and not app.get("welcome").is_async


def test_the_error_is_public_and_an_oncely_error() -> None:
    assert issubclass(oncely.EffectDeclarationError, oncely.OncelyError)
    assert issubclass(oncely.EffectDeclarationError, oncely.ConfigurationError)
    assert "EffectDeclarationError" in oncely.__all__


def test_one_model_declares_the_same_effect_as_a_list_of_it() -> None:
    declared = effects()
    declared.effect("single", on=Opened)(record_welcome)
    declared.effect("listed", on=[Opened])(record_welcome)
    single, listed = declared.get("single"), declared.get("listed")
    assert single.event_types == listed.event_types
    assert [t.name for t in single.event_types] == ["account.opened"]
