"""``Tasks``: an application's task handlers, by name; what ``oncely tasks run`` serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from oncely.errors import ConfigurationError
from oncely.tasks.errors import MissingHandlerError
from oncely.tasks.model import Task, TaskHandler


class Tasks:
    """Task handlers by name::

        tasks = Tasks()

        @tasks.handler("email.send")
        def send(task: Task) -> bool | None:
            provider.send(**task.payload, idempotency_key=task.idempotency_key)

    ``required`` names must have a handler before a worker starts (like every name of a task
    waiting in the database); a worker only leases tasks whose name has a handler.
    """

    def __init__(self, *, required: Iterable[str] = ()) -> None:
        self.required = frozenset(required)
        self._handlers: dict[str, TaskHandler] = {}

    def handler(self, name: str) -> Callable[[TaskHandler], TaskHandler]:
        """Register the decorated function as the handler of tasks named ``name``.

        Raises :class:`ConfigurationError` if ``name`` already has a handler.
        """

        def register(function: TaskHandler) -> TaskHandler:
            if name in self._handlers:
                raise ConfigurationError(f"task name {name!r} already has a handler")
            self._handlers[name] = function
            return function

        return register

    @property
    def names(self) -> frozenset[str]:
        """The names that have a handler."""
        return frozenset(self._handlers)

    def dispatch(self, task: Task) -> bool | Awaitable[bool | None] | None:
        """Run the handler of ``task.name``; :class:`MissingHandlerError` if it has none."""
        handler = self._handlers.get(task.name)
        if handler is None:
            raise MissingHandlerError([task.name])
        return handler(task)

    def missing(self, names: Iterable[str]) -> list[str]:
        """Of ``names`` and the required names, those without a handler, sorted."""
        return sorted((set(names) | self.required) - self._handlers.keys())
