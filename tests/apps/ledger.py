"""A small effects app for the consumer tests: a ledger, notifications and emails.

:func:`build` makes one app on topics of its own (``<prefix>account.credited``); the module-level
``effects`` is built from ``ONCELY_TEST_TOPIC_PREFIX`` and ``ONCELY_TEST_GROUP_PREFIX`` for
subprocesses (``oncely consume tests.apps.ledger:effects ...``). The ledger table has no
unique constraint of its own: a broken receipt would show up as a duplicate row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel

from oncely.consumers.effects import EffectContext, Effects, FailurePolicy
from oncely.events import Registry

SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (id text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ledger (event_id uuid, effect text, account_id text, amount int,
                                   n int, applied_at timestamptz DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS notifications (event_id uuid, account_id text REFERENCES accounts(id));
"""


def create_tables(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)


class AccountCredited(BaseModel):
    account_id: str
    amount: int
    n: int


@dataclass
class App:
    registry: Registry
    effects: Effects
    model: type[AccountCredited]

    @property
    def topic(self) -> str:
        return self.registry.for_model(self.model).topic


def _post(event: Any, ctx: EffectContext) -> None:
    if event.amount < 0:
        raise ValueError(f"negative amount {event.amount} for {event.account_id}")
    ctx.session.execute(
        sa.text(
            "INSERT INTO ledger (event_id, effect, account_id, amount, n)"
            " VALUES (:e, :f, :a, :m, :n)"
        ),
        {
            "e": ctx.event_id,
            "f": ctx.effect,
            "a": event.account_id,
            "m": event.amount,
            "n": event.n,
        },
    )


def _notify(event: Any, ctx: EffectContext) -> None:
    # Violates the foreign key until the account exists: the receipt rolls back with it.
    ctx.session.execute(
        sa.text("INSERT INTO notifications (event_id, account_id) VALUES (:e, :a)"),
        {"e": ctx.event_id, "a": event.account_id},
    )


def _email(event: Any, ctx: EffectContext) -> None:
    ctx.enqueue_task("email.send", {"to": event.account_id, "amount": event.amount})


def build(topic_prefix: str, group_prefix: str = "") -> App:
    registry = Registry(topic_prefix=topic_prefix)
    model = type("AccountCredited", (AccountCredited,), {"__module__": __name__})
    registry.register(model, name="account.credited", key="account_id", aggregate="account")
    effects = Effects(registry, group_prefix=group_prefix)
    quick = FailurePolicy(max_attempts=3, initial_backoff_seconds=0.1, max_backoff_seconds=0.2)
    patient = FailurePolicy(max_attempts=200, initial_backoff_seconds=0.1, max_backoff_seconds=0.2)
    blocking = FailurePolicy(max_attempts=2, initial_backoff_seconds=0.1, then="block")
    effects.effect("ledger", on=[model], failure=quick)(_post)
    effects.effect("audit", on=[model], failure=quick)(_post)
    effects.effect("notify", on=[model], failure=patient)(_notify)
    effects.effect("email", on=[model], failure=quick)(_email)
    effects.effect("strict", on=[model], failure=blocking)(_post)
    return App(registry, effects, model)


_app = build(
    os.environ.get("ONCELY_TEST_TOPIC_PREFIX", "ledger-test."),
    os.environ.get("ONCELY_TEST_GROUP_PREFIX", ""),
)
registry, effects = _app.registry, _app.effects
