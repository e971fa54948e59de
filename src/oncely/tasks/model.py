"""The values durable tasks are made of: a leased :class:`Task`, records and reports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from oncely.errors import ConfigurationError
from oncely.storage.queries import typed_row
from oncely.tasks.errors import TaskError
from oncely.tasks.rules import Policy

Renewer = Callable[["Task"], datetime]
"""Extends a task's lease on the database; returns the new ``lease_until``."""

TaskHandler = Callable[["Task"], bool | Awaitable[bool | None] | None]
"""Runs one attempt of a task. ``False`` means "not confirmed" (retry); raising means failed
(retry, or dead after the last attempt); anything else means done. A coroutine function works
too: the sync worker runs it to completion."""


@dataclass(kw_only=True)
class Task:
    """One leased attempt of a task, as a handler receives it.

    Give :attr:`idempotency_key` to the provider you call: it is the same on every attempt of
    this task, so a provider that de-duplicates by key applies the effect once.
    """

    id: UUID
    task_key: str
    name: str
    payload: Mapping[str, Any]
    policy: Policy
    attempt: int
    max_attempts: int
    lease_owner: str
    lease_until: datetime
    expires_at: datetime | None
    #: The trace context active when the task was enqueued (Java properties text), if any.
    trace_context: str | None = field(default=None, repr=False)
    _renewer: Renewer | None = field(default=None, repr=False, compare=False)

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts and reclaims of this task: its id."""
        return str(self.id)

    def renew_lease(self) -> datetime:
        """Extend this attempt's lease (irreversible tasks only) and return its new end.

        Call it while long irreversible work is running: the lease doubles as the heartbeat, and
        a lease that runs out makes the task ``stale``.

        Raises:
            ConfigurationError: the task is retry-safe (its lease expiring means "run it
                again"; give the worker a longer lease instead).
            TaskError: the task runs where renewal is not available (an
                :class:`~oncely.producer.commands.AsyncDurableCommand`'s immediate delivery).
            LeaseLostError: the lease already ran out or belongs to a newer attempt.
        """
        if self.policy != "irreversible":
            raise ConfigurationError(
                f"task {self.name!r} is retry-safe: its lease is never renewed (expiry means "
                "re-run); raise the worker's lease, or declare the task irreversible"
            )
        if self._renewer is None:
            raise TaskError(
                f"the lease of task {self.name!r} cannot be renewed in an async immediate "
                "delivery; leave long irreversible work to the worker"
            )
        self.lease_until = self._renewer(self)
        return self.lease_until


@dataclass(frozen=True, kw_only=True)
class QueuedTask:
    """What :func:`~oncely.tasks.enqueue_task` added (durable once committed)."""

    id: UUID
    task_key: str
    name: str


@dataclass(frozen=True, kw_only=True)
class TaskRecord:
    """A row of ``oncely_tasks``, for listings and operators."""

    id: UUID
    task_key: str
    name: str
    payload: Mapping[str, Any]
    policy: Policy
    status: str
    attempts: int
    max_attempts: int
    available_at: datetime
    expires_at: datetime | None
    lease_owner: str | None
    lease_until: datetime | None
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> TaskRecord:
        """The record of a row of ``oncely_tasks`` (a mapping with a key per field)."""
        return typed_row(cls, row)


AttemptOutcome = Literal["completed", "retry", "dead", "lease_lost"]


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """How one leased attempt ended.

    ``error`` is the handler's exception (``retry``/``dead``), or the :class:`LeaseLostError` that
    refused the settle; ``message`` is what was stored as ``last_error``; ``retry_in`` the
    backoff in seconds of a ``retry``.
    """

    task: Task
    outcome: AttemptOutcome
    error: BaseException | None = None
    message: str | None = None
    retry_in: float | None = None


@dataclass(frozen=True, kw_only=True)
class TaskFailure:
    """What a worker's observer is told: an attempt failed, or a task's lease or TTL ran out.

    ``outcome`` is ``retry`` or ``dead`` (after an attempt), ``lease_lost`` (its result was
    refused), ``requeued``, ``stale`` or ``failed`` (its lease expired), or ``expired`` (its TTL
    passed).
    """

    task_id: UUID
    task_key: str
    name: str
    attempt: int
    outcome: Literal["retry", "dead", "lease_lost", "requeued", "stale", "failed", "expired"]
    error: str
    retry_in: float | None = None

    @property
    def dead_letter(self) -> bool:
        """The task will not run again without an operator."""
        return self.outcome in ("dead", "stale", "failed", "expired")


Observer = Callable[[TaskFailure], None]
"""Told of every failure and dead letter (metrics, alerts). Its errors are logged, not raised."""
