"""A type checker checks an effect's handler against its ``on=`` model (mypy, strict)."""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

APP = """
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import oncely
from oncely import EffectContext

registry = oncely.Registry()


@registry.event("a.happened", topic="a", key="id", aggregate="a")
class A(BaseModel):
    id: str


@registry.event("b.happened", topic="b", key="id", aggregate="b")
class B(BaseModel):
    id: str


effects = oncely.Effects(registry)


@effects.effect("typed", on=A)
def typed(event: A, ctx: EffectContext[Session]) -> None: ...


@effects.effect("async", on=A)
async def asynchronous(event: A, ctx: EffectContext[AsyncSession]) -> None: ...


@effects.effect("batch", on=A, batch=True)
def batch(events: list[tuple[A, EffectContext[Session]]]) -> None: ...


@effects.effect("several", on=[A, B])
def several(event: A | B, ctx: EffectContext[Session]) -> None: ...


@effects.effect("wrong-model", on=A)
def wrong_model(event: B, ctx: EffectContext[Session]) -> None: ...


@effects.effect("batch-not-per-event", on=A, batch=True)
def batch_not_per_event(event: A, ctx: EffectContext[Session]) -> None: ...
"""


def test_a_handler_of_another_model_is_a_type_error(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    report, errors, _ = api.run(["--strict", "--no-error-summary", str(app)])
    assert not errors
    flagged = {int(m.group(1)) for m in re.finditer(r"app\.py:(\d+): error", report)}
    # mypy reports a decorator's argument on the decorator's line
    wrong = ('"wrong-model"', '"batch-not-per-event"')
    expected = {
        n + 1
        for n, line in enumerate(APP.splitlines())
        if line.startswith("@") and any(w in line for w in wrong)
    }
    assert flagged == expected, report
