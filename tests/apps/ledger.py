"""A small effects app for the consumer tests: a ledger, notifications and emails.

:func:`build` makes one app on topics of its own (``<prefix>account.credited``); the module-level
``effects`` is built from ``ONCELY_TEST_TOPIC_PREFIX`` and ``ONCELY_TEST_GROUP_PREFIX`` for
subprocesses (``oncely consume tests.apps.ledger:effects ...``). The ledger table has no
unique constraint of its own: a broken receipt would show up as a duplicate row.

``ledger`` writes through ``ctx.session`` and ``audit`` through ``ctx.insert``. With ``ways``
(and in the module-level app), ``ledger`` and ``notify`` also come in every other way a handler
can write: ``.insert`` through ``ctx.insert`` (written once per batch), ``.batch`` as a
``batch=True`` handler, ``.async`` as an ``async def`` handler on an ``AsyncSession``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel

from oncely.consumers.effects import AsyncEffectContext, EffectContext, Effects, FailurePolicy
from oncely.events import Registry
from tests.apps import EffectsApp, create_schema

SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ledger (event_id uuid, effect text, account_id text, amount int,
                                   n int, applied_at timestamptz DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS notifications (event_id uuid, account_id text REFERENCES accounts(id));
"""


metadata = sa.MetaData()
ledger = sa.Table(
    "ledger",
    metadata,
    sa.Column("event_id", sa.Uuid),
    sa.Column("effect", sa.Text),
    sa.Column("account_id", sa.Text),
    sa.Column("amount", sa.Integer),
    sa.Column("n", sa.Integer),
)
notifications = sa.Table(
    "notifications", metadata, sa.Column("event_id", sa.Uuid), sa.Column("account_id", sa.Text)
)


def create_tables(engine: sa.Engine) -> None:
    create_schema(engine, SCHEMA)


class AccountCredited(BaseModel):
    account_id: str
    amount: int
    n: int


@dataclass
class App(EffectsApp):
    model: type[AccountCredited]

    @property
    def env(self) -> dict[str, str]:
        """The environment in which ``tests.apps.ledger:effects`` (and ``:registry``) is this
        app, for a process that imports it."""
        return {
            "ONCELY_TEST_TOPIC_PREFIX": self.registry.topic_prefix,
            "ONCELY_TEST_GROUP_PREFIX": self.effects.group_prefix,
        }


def _ledger_row(event: Any, ctx: EffectContext[Any]) -> dict[str, Any]:
    if event.amount < 0:
        raise ValueError(f"negative amount {event.amount} for {event.account_id}")
    return {
        "event_id": ctx.event_id,
        "effect": ctx.effect,
        "account_id": event.account_id,
        "amount": event.amount,
        "n": event.n,
    }


def _notification(event: Any, ctx: EffectContext[Any]) -> dict[str, Any]:
    # Violates the foreign key until the account exists: the receipt rolls back with it.
    return {"event_id": ctx.event_id, "account_id": event.account_id}


@dataclass(frozen=True)
class _Writes:
    """Handlers that write ``row(event, ctx)`` into ``table``, one for each way a handler can
    write: through ``ctx.session``, through ``ctx.insert``, as a batch handler, as an async one."""

    table: sa.Table
    row: Callable[[Any, EffectContext[Any]], dict[str, Any]]

    def session(self, event: Any, ctx: EffectContext) -> None:
        ctx.session.execute(sa.insert(self.table).values(self.row(event, ctx)))

    def insert(self, event: Any, ctx: EffectContext) -> None:
        ctx.insert(self.table, self.row(event, ctx))

    def batch(self, batch: Sequence[tuple[Any, EffectContext]]) -> None:
        for event, ctx in batch:
            self.insert(event, ctx)

    async def session_async(self, event: Any, ctx: AsyncEffectContext) -> None:
        row = self.row(event, ctx)
        await asyncio.sleep(0)  # a real await between the handler's start and its write
        await ctx.session.execute(sa.insert(self.table).values(row))


_post = _Writes(ledger, _ledger_row)
_notify = _Writes(notifications, _notification)


def _email(event: Any, ctx: EffectContext) -> None:
    ctx.enqueue_task("email.send", {"to": event.account_id, "amount": event.amount})


def build(topic_prefix: str, group_prefix: str = "", *, ways: bool = False) -> App:
    """The app on ``<topic_prefix>account.credited``; with ``ways``, also the ``.insert``,
    ``.batch`` and ``.async`` variants of ``ledger`` and ``notify``."""
    registry = Registry(topic_prefix=topic_prefix)
    model = type("AccountCredited", (AccountCredited,), {"__module__": __name__})
    registry.register(model, name="account.credited", key="account_id", aggregate="account")
    effects = Effects(registry, group_prefix=group_prefix)
    quick = FailurePolicy(max_attempts=3, initial_backoff_seconds=0.1, max_backoff_seconds=0.2)
    patient = FailurePolicy(max_attempts=200, initial_backoff_seconds=0.1, max_backoff_seconds=0.2)
    blocking = FailurePolicy(max_attempts=2, initial_backoff_seconds=0.1, then="block")
    effects.effect("ledger", on=[model], failure=quick)(_post.session)
    effects.effect("audit", on=[model], failure=quick)(_post.insert)
    effects.effect("notify", on=[model], failure=patient)(_notify.session)
    if ways:
        for name, writes, failure in [("ledger", _post, quick), ("notify", _notify, patient)]:
            effects.effect(f"{name}.insert", on=[model], failure=failure)(writes.insert)
            effects.effect(f"{name}.batch", on=[model], failure=failure, batch=True)(writes.batch)
            effects.effect(f"{name}.async", on=[model], failure=failure)(writes.session_async)
    effects.effect("email", on=[model], failure=quick)(_email)
    effects.effect("strict", on=[model], failure=blocking)(_post.session)
    return App(registry, effects, model)


_app = build(
    os.environ.get("ONCELY_TEST_TOPIC_PREFIX", "ledger-test."),
    os.environ.get("ONCELY_TEST_GROUP_PREFIX", ""),
    ways=True,
)
registry, effects = _app.registry, _app.effects
