"""Durable commands: business writes, events and tasks in one commit, then the
immediate delivery of the tasks that can be tried at once.

:meth:`DurableCommand.execute` runs the caller's business function on a new session inside one
transaction; the function may stage Kafka events itself (``stage(session, event)``) and
enqueue tasks; the command then enqueues the ``tasks`` (:class:`PostCommitTask`) and commits.
Any error before the commit rolls everything back, and is raised as is. Two tasks with the
same task key in one transaction are refused
(:class:`~oncely.storage.transactional.DuplicateInTransactionError`).

After the commit, each task with a ``deliver`` callable is leased by its key, delivered, and
settled with the same fence as the worker's (attempt and owner, on the database clock):

- ``deliver`` returns anything but ``False``: the task is ``completed``;
- it returns ``False`` ("not confirmed"): a retry is scheduled with the worker's backoff; the
  task is reported pending, not as an error;
- it raises: the task records ``attempts=1`` and ``last_error`` and is retried (or is dead
  after its last attempt), and :class:`PostCommitTaskError` is raised, carrying the
  :class:`PostCommitResult`: the business is committed, the worker retries the rest;
- the settle finds the lease lost: :class:`~oncely.tasks.LeaseLostError` is among the
  errors of the :class:`PostCommitTaskError`; success is never reported over a newer owner.

If a worker leased the task first (it wakes at the commit), it is simply pending.
The rules are written once (:func:`_stage`, :func:`_post_commit_steps`) and driven by a sync
(:class:`DurableCommand`) and an async (:class:`AsyncDurableCommand`) runner.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from oncely.errors import OncelyError
from oncely.runtime.process import process_id
from oncely.runtime.retry import Backoff
from oncely.runtime.steps import Step, drive, drive_async
from oncely.tasks import (
    DEFAULT_BACKOFF,
    DEFAULT_LEASE_SECONDS,
    Policy,
    Renewer,
    TaskHandler,
    TaskStore,
    deliver_steps,
    enqueue_task,
)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class PostCommitTask:
    """A task enqueued with the business writes (see :func:`~oncely.tasks.enqueue_task`
    for the fields); with ``deliver``, it is also tried once right after the commit.

    ``deliver`` is usually the handler the worker's :class:`~oncely.tasks.Tasks` app
    registered for ``name``, which runs the retries.
    """

    name: str
    payload: Mapping[str, Any]
    policy: Policy = "retry_safe"
    task_key: str | None = None
    ttl: timedelta | None = None
    max_attempts: int | None = None
    available_at: datetime | timedelta | None = None
    deliver: TaskHandler | None = None


PostCommitTasks = Iterable[PostCommitTask] | Callable[[T], Iterable[PostCommitTask]]
"""The tasks, or a function of the business function's return value that gives them."""


@dataclass(frozen=True)
class PostCommitResult(Generic[T]):
    """What a command did: the business value, and which task keys completed or are pending.

    ``pending_tasks`` are committed tasks the worker will run (or retry).
    """

    value: T
    business_committed: bool
    completed_tasks: tuple[str, ...] = ()
    pending_tasks: tuple[str, ...] = ()


class PostCommitTaskError(OncelyError):
    """The business transaction committed, but an immediate delivery failed.

    ``result`` is the :class:`PostCommitResult` (``business_committed`` is true); ``errors``
    the exceptions of the failed deliveries. The worker retries the pending tasks.
    """

    def __init__(self, result: PostCommitResult[Any], errors: Iterable[BaseException]) -> None:
        self.result = result
        self.errors = tuple(errors)
        reasons = "; ".join(f"{type(e).__name__}: {e}" for e in self.errors)
        super().__init__(
            f"committed; {len(self.errors)} immediate delivery(ies) failed, the rest will be "
            f"retried by the worker (pending: {', '.join(result.pending_tasks)}): {reasons}"
        )


_Staged = list[tuple[str, TaskHandler | None]]


def _stage(session: Session | AsyncSession, tasks: PostCommitTasks[T], value: T) -> _Staged:
    """Enqueue the tasks in the session's transaction; keys paired with deliver."""
    resolved = tasks(value) if callable(tasks) else tasks
    return [
        (
            enqueue_task(
                session,
                task.name,
                task.payload,
                policy=task.policy,
                task_key=task.task_key,
                ttl=task.ttl,
                max_attempts=task.max_attempts,
                available_at=task.available_at,
            ).task_key,
            task.deliver,
        )
        for task in resolved
    ]


def _post_commit_steps(
    value: T,
    staged: _Staged,
    *,
    owner: str,
    lease_seconds: float,
    backoff: Backoff,
    renewer: Renewer | None,
) -> Generator[Step, Any, tuple[PostCommitResult[T], list[BaseException]]]:
    """Deliver each task that has ``deliver``, in order; return the result and the errors.

    Errors are returned, not raised, so no settle is ever rolled back.
    """
    completed: list[str] = []
    errors: list[BaseException] = []
    for task_key, deliver in staged:
        if deliver is None:
            continue
        attempt = yield from deliver_steps(
            owner, task_key, deliver, lease_seconds=lease_seconds, backoff=backoff, renewer=renewer
        )
        if attempt is None:
            continue
        if attempt.outcome == "completed":
            completed.append(task_key)
        elif attempt.error is not None:
            errors.append(attempt.error)
    result = PostCommitResult(
        value=value,
        business_committed=True,
        completed_tasks=tuple(completed),
        pending_tasks=tuple(key for key, _ in staged if key not in completed),
    )
    return result, errors


def _finish(result: PostCommitResult[T], errors: list[BaseException]) -> PostCommitResult[T]:
    if errors:
        raise PostCommitTaskError(result, errors)
    return result


class DurableCommand:
    """Run business functions durably on a sync ``Engine`` (see the module docstring).

    ``lease_seconds`` bounds an immediate delivery (a lease that runs out means the worker's
    sweep decides); ``backoff`` is the retry schedule after a failed one.
    """

    def __init__(
        self,
        *,
        engine: sa.Engine,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        backoff: Backoff | None = None,
    ) -> None:
        self.engine = engine
        self.store = TaskStore(engine=engine, lease_seconds=lease_seconds, backoff=backoff)
        self.owner = f"command-{process_id()}"

    def execute(
        self, stage_business: Callable[[Session], T], *, tasks: PostCommitTasks[T] = ()
    ) -> PostCommitResult[T]:
        """Commit ``stage_business(session)`` with ``tasks``, then deliver the immediate ones.

        ``stage_business`` must not commit. Raises whatever it (or the commit) raises, with
        nothing committed; :class:`PostCommitTaskError` once committed if a delivery failed.
        """
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            value = stage_business(session)
            staged = _stage(session, tasks, value)
        steps = _post_commit_steps(
            value,
            staged,
            owner=self.owner,
            lease_seconds=self.store.lease_seconds,
            backoff=self.store.backoff,
            renewer=self.store.renew,
        )
        return _finish(*drive(self.engine, steps))


class AsyncDurableCommand:
    """:class:`DurableCommand` on an ``AsyncEngine``: the same rules, awaited.

    ``deliver`` may be a coroutine function. Its ``task.renew_lease()`` is not available here:
    leave long irreversible work to the worker.
    """

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        backoff: Backoff | None = None,
    ) -> None:
        self.engine = engine
        self.lease_seconds = lease_seconds
        self.backoff = backoff or DEFAULT_BACKOFF
        self.owner = f"command-{process_id()}"

    async def execute(
        self,
        stage_business: Callable[[AsyncSession], Awaitable[T]],
        *,
        tasks: PostCommitTasks[T] = (),
    ) -> PostCommitResult[T]:
        """Commit ``await stage_business(session)`` with ``tasks``, then deliver; see
        :meth:`DurableCommand.execute`."""
        async with AsyncSession(self.engine, expire_on_commit=False) as session, session.begin():
            value = await stage_business(session)
            staged = _stage(session, tasks, value)
        steps = _post_commit_steps(
            value,
            staged,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            backoff=self.backoff,
            renewer=None,
        )
        return _finish(*await drive_async(self.engine, steps))
