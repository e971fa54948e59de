"""Two versions of one event type, as a producer and a consumer see them around a deploy.

``order.placed`` v1 has ``order_id`` and ``amount``; v2 adds ``currency`` with a default, a
change compatible both ways (FULL). :func:`build` makes both versions on one topic of its own;
the module-level ``effects_v1`` / ``effects_v2`` (and ``registry_v1`` / ``registry_v2``) are
built from ``ONCELY_TEST_TOPIC_PREFIX``, ``ONCELY_TEST_GROUP_PREFIX`` and
``ONCELY_TEST_ENCODING`` for subprocesses (``oncely consume tests.apps.orders:effects_v2 ...``).
Each version's ``orders`` effect records what its code saw, and which code version applied it.
"""

from __future__ import annotations

import os
from typing import Any, cast

import sqlalchemy as sa
from pydantic import BaseModel

from oncely.consumers.effects import EffectContext, Effects, FailurePolicy
from oncely.events import Encoding, Registry
from tests.apps import EffectsApp, create_schema

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders_applied (
    event_id uuid, order_id text, amount int, currency text, code_version int
);
"""


def create_tables(engine: sa.Engine) -> None:
    create_schema(engine, SCHEMA)


class OrderPlacedV1(BaseModel):
    order_id: str
    amount: int


class OrderPlacedV2(BaseModel):
    order_id: str
    amount: int
    currency: str = "EUR"


#: One version of the app: its registry, its effects and its ``order.placed`` model.
Version = EffectsApp


def _record(code_version: int) -> Any:
    def apply(event: Any, ctx: EffectContext) -> None:
        ctx.session.execute(
            sa.text(
                "INSERT INTO orders_applied (event_id, order_id, amount, currency, code_version)"
                " VALUES (:e, :o, :a, :c, :v)"
            ),
            {
                "e": ctx.event_id,
                "o": event.order_id,
                "a": event.amount,
                "c": getattr(event, "currency", None),
                "v": code_version,
            },
        )

    return apply


def build(
    topic_prefix: str, group_prefix: str = "", encoding: Encoding = "avro"
) -> tuple[Version, Version]:
    """v1 and v2 of ``order.placed`` on ``<topic_prefix>order.placed``, each with an effect."""
    versions = []
    quick = FailurePolicy(max_attempts=2, initial_backoff_seconds=0.1, max_backoff_seconds=0.1)
    for number, base in [(1, OrderPlacedV1), (2, OrderPlacedV2)]:
        registry = Registry(topic_prefix=topic_prefix)
        model = type("OrderPlaced", (base,), {"__module__": __name__})
        registry.register(
            model,
            name="order.placed",
            key="order_id",
            aggregate="order",
            version=number,
            encoding=encoding,
        )
        effects = Effects(registry, group_prefix=group_prefix)
        effects.effect("orders", on=[model], failure=quick)(_record(number))
        versions.append(Version(registry, effects, model))
    return versions[0], versions[1]


_v1, _v2 = build(
    os.environ.get("ONCELY_TEST_TOPIC_PREFIX", "orders-test."),
    os.environ.get("ONCELY_TEST_GROUP_PREFIX", ""),
    cast(Encoding, os.environ.get("ONCELY_TEST_ENCODING", "avro")),
)
registry_v1, effects_v1 = _v1.registry, _v1.effects
registry_v2, effects_v2 = _v2.registry, _v2.effects
