"""The consumer cells' effects app: one event type, ``credited``, and two effects writing one
``bench_effects`` row per event with ``ctx.insert`` (the batch-write API):

- ``apply`` writes the row (R3, R3-fair, R3-dup, R4, R4-quiet, R-RSS);
- ``wait`` waits 2 ms (``time.sleep(0.002)``, a handler calling a slow service), then writes
  the row (R-LANES).

``oncely consume bench.effects_app:effects --effect apply`` runs it as a process; its topic and
group prefixes come from ``ONCELY_BENCH_TOPIC_PREFIX`` and ``ONCELY_BENCH_GROUP_PREFIX``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from oncely.consumers.effects import EffectContext, Effects
from oncely.events import Registry

#: What the ``wait`` effect's handler waits per record, in seconds.
WAIT_SECONDS = 0.002


class Credited(BaseModel):
    account: str
    amount: int


class _Base(DeclarativeBase):
    pass


class BenchEffect(_Base):
    """The effect's row (the table has no key: the mapper's key is the event id)."""

    __tablename__ = "bench_effects"
    event_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    amount: Mapped[int]


def create_effects_table(engine: sa.Engine) -> None:
    """``bench_effects (event_id uuid, amount int, written_at timestamptz)``, no key and no
    index, if missing. ``written_at`` defaults to ``clock_timestamp()``: when the row was
    inserted (just before its transaction's commit, for ``ctx.insert`` rows)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE IF NOT EXISTS bench_effects (event_id uuid, amount int)")
        )
        conn.execute(
            sa.text(
                "ALTER TABLE bench_effects ADD COLUMN IF NOT EXISTS written_at timestamptz"
                " NOT NULL DEFAULT clock_timestamp()"
            )
        )


def _write(ctx: EffectContext, values: dict[str, Any]) -> None:
    ctx.insert(BenchEffect, values)


def build_effects(topic_prefix: str, group_prefix: str) -> Effects:
    """The app: ``credited`` on ``<topic_prefix>...`` and the ``apply`` and ``wait`` effects."""
    registry = Registry(topic_prefix=topic_prefix)
    # A class of its own per registry: a model is registered in one registry only.
    model = type("Credited", (Credited,), {"__module__": __name__})
    registry.register(model, name="credited", key="account", aggregate="account")
    effects = Effects(registry, group_prefix=group_prefix)

    def apply(event: Credited, ctx: EffectContext) -> None:
        _write(ctx, {"event_id": ctx.event_id, "amount": event.amount})

    def wait(event: Credited, ctx: EffectContext) -> None:
        time.sleep(WAIT_SECONDS)
        _write(ctx, {"event_id": ctx.event_id, "amount": event.amount})

    effects.effect("apply", on=[model])(apply)
    effects.effect("wait", on=[model])(wait)
    return effects


#: What ``oncely consume bench.effects_app:effects`` runs (prefixes from the environment).
effects = build_effects(
    os.environ.get("ONCELY_BENCH_TOPIC_PREFIX", "bench-effects."),
    os.environ.get("ONCELY_BENCH_GROUP_PREFIX", ""),
)
