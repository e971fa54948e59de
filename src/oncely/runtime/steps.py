"""Rules written once, as generators of steps, and the two drivers that run them, sync and async.

The task store, post-commit commands and idempotency keys write their rules this way, so that
the sync and async APIs cannot drift. A generator yields :class:`Sql` steps (it receives the
rows) and :class:`Call` steps (a handler runs; it receives a :class:`Ran`), then returns its
result. Consecutive statements run
in one transaction; that transaction commits before a handler runs, so no transaction is open
while an effect happens. :func:`drive` runs steps on a sync ``Engine``; :func:`drive_async`
runs the very same statement loop on an ``AsyncEngine`` through ``AsyncConnection.run_sync``
and awaits the handlers.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Sql:
    """Execute a named statement; the generator receives ``list[Row]``."""

    statement: sa.TextClause
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Call:
    """Run ``handler(arg)`` outside any transaction (awaited if it returns an awaitable); the
    generator receives a :class:`Ran`."""

    handler: Callable[[Any], object]
    arg: Any


@dataclass(frozen=True)
class Ran:
    """What a handler did: returned ``value``, or raised ``error``."""

    value: object = None
    error: Exception | None = None


Step = Sql | Call


@dataclass(frozen=True)
class _Done(Generic[R]):
    value: R


def _advance(steps: Generator[Step, Any, R], reply: Any) -> Step | _Done[R]:
    try:
        return steps.send(reply)
    except StopIteration as done:
        return _Done(done.value)


def _statements(
    conn: sa.Connection, steps: Generator[Step, Any, R], step: Step | _Done[R]
) -> Step | _Done[R]:
    """Execute statements from ``step`` on, in ``conn``; return the next call or the end."""
    while isinstance(step, Sql):
        step = _advance(steps, conn.execute(step.statement, dict(step.params)).all())
    return step


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _call(step: Call) -> Ran:
    try:
        value = step.handler(step.arg)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except Exception as exc:
        return Ran(error=exc)
    return Ran(value=value)


async def _call_async(step: Call) -> Ran:
    try:
        value = step.handler(step.arg)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        return Ran(error=exc)
    return Ran(value=value)


def drive(engine: sa.Engine, steps: Generator[Step, Any, R]) -> R:
    """Run ``steps`` on a sync engine and return the generator's result.

    Errors of the generator or the database propagate after rolling back the open transaction;
    a handler's ``Exception`` is handed to the generator, never raised here.
    """
    step = _advance(steps, None)
    while not isinstance(step, _Done):
        if isinstance(step, Call):
            step = _advance(steps, _call(step))
        else:
            with engine.begin() as conn:
                step = _statements(conn, steps, step)
    return step.value


async def drive_async(engine: AsyncEngine, steps: Generator[Step, Any, R]) -> R:
    """:func:`drive` on an async engine: the same statement loop, handlers awaited."""
    step = _advance(steps, None)
    while not isinstance(step, _Done):
        if isinstance(step, Call):
            step = _advance(steps, await _call_async(step))
        else:
            async with engine.begin() as conn:
                step = await conn.run_sync(_statements, steps, step)
    return step.value
