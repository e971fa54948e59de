"""Database errors translated into oncely's hierarchy, by constraint name, at the driver boundary.

Importing this module installs a SQLAlchemy ``handle_error`` hook on every ``Engine``: a unique
violation of one of oncely's own constraints is raised as the matching :class:`OncelyError`
subclass (the original ``IntegrityError`` is its ``__cause__``); every other error is left
untouched, so an application's own integrity errors propagate as they always did.
"""

from __future__ import annotations

import psycopg.errors
import sqlalchemy as sa
from sqlalchemy.engine import ExceptionContext

from oncely.errors import OncelyError


class DuplicateEventKeyError(OncelyError):
    """An event with this event key was already staged (the outbox's event_key is unique)."""


class DuplicateTaskKeyError(OncelyError):
    """A task with this task key already exists (the tasks' task_key is unique)."""


_UNIQUE_CONSTRAINTS: dict[str, tuple[type[OncelyError], str]] = {
    "oncely_outbox_event_key_key": (
        DuplicateEventKeyError,
        "an event with this event_key was already staged in an earlier transaction",
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


@sa.event.listens_for(sa.Engine, "handle_error")
def _translate_unique_violations(context: ExceptionContext) -> BaseException | None:
    return translate(context.original_exception)
