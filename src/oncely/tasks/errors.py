"""Errors of durable tasks; every one is an :class:`~oncely.errors.OncelyError`."""

from __future__ import annotations

from collections.abc import Iterable

from oncely.errors import ConfigurationError, OncelyError


class TaskError(OncelyError):
    """A durable task could not be leased, settled or changed."""


class LeaseLostError(TaskError):
    """The lease of this attempt is gone (it expired, was swept or re-leased): result refused.

    Raised by a settle or a renewal whose fenced UPDATE matched no row. The task's state belongs
    to whoever holds it now; never report the attempt as a success.
    """


class TaskNotFoundError(TaskError):
    """No task has this id."""


class NotReclaimableError(TaskError):
    """Only a stale, dead or failed task can be reclaimed."""


class MissingHandlerError(ConfigurationError):
    """Some task names have no handler, so the worker refuses to start.

    ``names`` lists them, sorted: tasks waiting in the database (queued or leased) or names the
    :class:`~oncely.tasks.Tasks` app declares as required.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(sorted(names))
        super().__init__(
            "refusing to start: no handler for task name(s) "
            f"{', '.join(map(repr, self.names))}: register them with @tasks.handler(name) before "
            "starting the worker"
        )
