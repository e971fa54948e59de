"""Database errors translated into oncely's hierarchy, by constraint name, at the driver boundary;
and the one error that means oncely's tables are missing (:func:`missing_tables`).

:func:`translate_errors_of` installs a SQLAlchemy ``handle_error`` hook on the engine of the
session or connection oncely writes through (``stage()``, ``enqueue_task()`` call it; no other
engine of the process is touched): a unique violation of one of oncely's own constraints is
raised as the matching :class:`OncelyError` subclass (the original ``IntegrityError`` is its
``__cause__``); every other error is left untouched, so an application's own integrity errors
propagate as they always did.
"""

from __future__ import annotations

import weakref

import psycopg.errors
import sqlalchemy as sa
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from oncely.errors import OncelyError


class DuplicateEventError(OncelyError):
    """An event with this idempotency key was already staged by an earlier transaction (the
    outbox's ``event_key`` column is unique)."""


class DuplicateTaskKeyError(OncelyError):
    """A task with this task key already exists (the tasks' task_key is unique)."""


_UNIQUE_CONSTRAINTS: dict[str, tuple[type[OncelyError], str]] = {
    "oncely_outbox_event_key_key": (
        DuplicateEventError,
        "an event with this idempotency_key was already staged in an earlier transaction",
    ),
    "oncely_tasks_task_key_key": (
        DuplicateTaskKeyError,
        "a task with this task_key already exists",
    ),
}


def translate(error: BaseException) -> OncelyError | None:
    """The oncely error for a driver error on one of oncely's unique constraints, else ``None``."""
    if not isinstance(error, psycopg.errors.UniqueViolation):
        return None
    known = _UNIQUE_CONSTRAINTS.get(error.diag.constraint_name or "")
    if known is None:
        return None
    cls, what = known
    detail = error.diag.message_detail or ""
    return cls(f"{what}: {detail}".rstrip(": "))


#: What a process says, once, when the database it runs on has none of oncely's tables.
MISSING_TABLES = "the database has no oncely tables: run `oncely db upgrade`"


def missing_tables(error: BaseException) -> bool:
    """Whether ``error`` (the driver's, or SQLAlchemy's around it) says a table the statement
    reads does not exist: oncely's tables are not in the database, or not on its search path."""
    cause = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    return isinstance(cause, psycopg.errors.UndefinedTable)


def _translate_unique_violations(context: ExceptionContext) -> BaseException | None:
    return translate(context.original_exception)


_translating: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
#: Sessions and connections whose engine is hooked: ``stage()`` checks this on every call.
_hooked: weakref.WeakSet[Session | AsyncSession | sa.Connection] = weakref.WeakSet()


def translate_errors_of(target: Session | AsyncSession | sa.Connection) -> None:
    """Raise oncely's errors for violations of its constraints on ``target``'s engine, at
    execute, flush or commit, from now on (once per engine; a session without a bind: no-op)."""
    if target in _hooked:
        return
    session = target.sync_session if isinstance(target, AsyncSession) else target
    try:
        bind = session.engine if isinstance(session, sa.Connection) else session.get_bind()
    except sa.exc.UnboundExecutionError:  # bound per table or mapper: nothing to hook here
        return
    engine = bind.engine if isinstance(bind, sa.Connection) else bind
    if engine not in _translating:
        sa.event.listen(engine, "handle_error", _translate_unique_violations)
        _translating.add(engine)
    _hooked.add(target)
