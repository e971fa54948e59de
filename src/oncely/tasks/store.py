"""State changes of ``oncely_tasks``: each one named statement of ``storage/sql/tasks.sql``,
and the insert of a new task in its caller's transaction (:func:`add_task`).

The step generators here hold the rules (what to execute, what a missing row means); the
decisions come from :mod:`.rules`; :mod:`.steps` runs them sync or async. :class:`TaskStore` is
the sync API over them, for the worker, the CLI and operators' scripts.

Every settle (complete, retry, dead) and every renewal is fenced: it matches only the task's
current attempt, leased by the same owner, while the lease runs on the database clock. A
settle that matches nothing raises :class:`LeaseLostError`; nothing is overwritten.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from oncely.errors import error_text
from oncely.runtime.retry import Backoff
from oncely.runtime.steps import Call, Ran, Sql, Step, drive
from oncely.runtime.tracing import Tracing
from oncely.storage.errors import translate_errors_of
from oncely.storage.queries import purge_in_batches, query, typed_row
from oncely.storage.tables import TASK_STATUSES, tasks
from oncely.storage.transactional import Transactional, TransactionalTable
from oncely.tasks.errors import LeaseLostError, NotReclaimableError, TaskError, TaskNotFoundError
from oncely.tasks.model import (
    Attempt,
    Renewer,
    Task,
    TaskFailure,
    TaskHandler,
    TaskRecord,
)
from oncely.tasks.rules import (
    DEFAULT_BACKOFF,
    NOT_CONFIRMED,
    FailureDecision,
    after_failure,
    after_lease_expiry,
)

DEFAULT_LEASE_SECONDS = 60.0
"""How long a worker holds a task's attempt before another worker may take it over."""
SWEEP_BATCH = 100
PURGE_BATCH = 1000


def _insert(connection: sa.Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    translate_errors_of(connection)  # a key an earlier transaction used: DuplicateTaskKeyError
    for row in rows:  # a row's values may be SQL (now() + a delay): one statement each
        connection.execute(sa.insert(tasks).values(row))


_TASKS = TransactionalTable(
    tasks, key="task_key", what="task key", hint="give each task its own task_key", insert=_insert
)


def add_task(target: Transactional, row: Mapping[str, Any]) -> None:
    """Insert a task ``row`` (column -> value or SQL expression) in ``target``'s transaction:
    at once with a ``Session`` or ``Connection``, at the next flush with an ``AsyncSession``.

    Raises:
        DuplicateInTransactionError: its task key was given earlier in this transaction.
        DuplicateTaskKeyError: an earlier transaction has a task with this key (with an
            ``AsyncSession``: at flush or commit).
    """
    _TASKS.add(target, [row])


def lease_sql(owner: str, names: Iterable[str], lease_seconds: float) -> Sql:
    """Lease the oldest due queued task whose name is in ``names``."""
    return Sql(
        query("task_lease"),
        {"owner": owner, "names": sorted(names), "lease_seconds": float(lease_seconds)},
    )


def lease_by_key_sql(owner: str, task_key: str, lease_seconds: float) -> Sql:
    """Lease the task with this key if it is queued and due."""
    return Sql(
        query("task_lease_by_key"),
        {"owner": owner, "task_key": task_key, "lease_seconds": float(lease_seconds)},
    )


def deliver_steps(
    owner: str,
    task_key: str,
    handler: TaskHandler,
    *,
    lease_seconds: float,
    backoff: Backoff,
    renewer: Renewer | None,
) -> Generator[Step, Any, Attempt | None]:
    """Lease the task with ``task_key`` if it is queued and due, run ``handler`` on it and
    settle the result with the worker's fence; ``None`` when it was not leased (a worker was
    first). Drive with :func:`oncely.runtime.steps.drive` (or ``drive_async``)."""
    lease = lease_by_key_sql(owner, task_key, lease_seconds)
    return (yield from attempt_steps(lease, handler, backoff=backoff, renewer=renewer))


def _fence(task: Task) -> dict[str, Any]:
    return {"id": task.id, "attempt": task.attempt, "owner": task.lease_owner}


def _lost(task: Task, refused: str) -> LeaseLostError:
    return LeaseLostError(
        f"attempt {task.attempt} of task {task.name!r} ({task.id}) is no longer leased by "
        f"{task.lease_owner}: {refused}"
    )


def lease_steps(lease: Sql, renewer: Renewer | None) -> Generator[Step, Any, Task | None]:
    rows = yield lease
    return typed_row(Task, rows[0]._mapping, _renewer=renewer) if rows else None


def complete_steps(task: Task) -> Generator[Step, Any, None]:
    """Mark the attempt completed; :class:`LeaseLostError` if the fence refuses it."""
    if not (yield Sql(query("task_complete"), _fence(task))):
        raise _lost(task, "its success is not recorded")


def fail_steps(task: Task, message: str, backoff: Backoff) -> Generator[Step, Any, FailureDecision]:
    """Schedule a retry with backoff, or bury the last attempt as dead; fenced likewise."""
    decision = after_failure(task.attempt, task.max_attempts, backoff)
    params = {**_fence(task), "error": error_text(message)}
    if decision.dead:
        settled = yield Sql(query("task_dead"), params)
    else:
        settled = yield Sql(query("task_retry"), {**params, "delay_seconds": decision.delay})
    if not settled:
        raise _lost(task, f"its failure is not recorded ({error_text(message)})")
    return decision


def renew_steps(task: Task, lease_seconds: float) -> Generator[Step, Any, datetime]:
    rows = yield Sql(query("task_renew"), {**_fence(task), "lease_seconds": float(lease_seconds)})
    if not rows:
        raise _lost(task, "its lease cannot be renewed")
    lease_until: datetime = rows[0].lease_until
    return lease_until


_TRACING = Tracing()


def attempt_steps(
    lease: Sql,
    handler: TaskHandler,
    *,
    backoff: Backoff,
    renewer: Renewer | None,
    tracing: Tracing = _TRACING,
) -> Generator[Step, Any, Attempt | None]:
    """Lease one task, run ``handler`` on it outside any transaction, settle the result.

    Returns ``None`` when nothing was leased. A lost lease is an ``Attempt`` with outcome
    ``lease_lost`` (its ``error`` is the :class:`LeaseLostError`), never a success. The handler
    runs inside the task's span (:meth:`~oncely.runtime.tracing.Tracing.task`).
    """
    task = yield from lease_steps(lease, renewer)
    if task is None:
        return None

    def traced(leased: Task) -> object:
        return tracing.task(
            handler,
            leased,
            name=leased.name,
            task_id=str(leased.id),
            attempt=leased.attempt,
            staged=leased.trace_context,
        )

    ran: Ran = yield Call(traced, task)
    try:
        if ran.error is None and ran.value is not False:
            yield from complete_steps(task)
            return Attempt(task=task, outcome="completed")
        message = NOT_CONFIRMED if ran.error is None else error_text(ran.error)
        decision = yield from fail_steps(task, message, backoff)
    except LeaseLostError as lost:
        return Attempt(task=task, outcome="lease_lost", error=lost)
    return Attempt(
        task=task,
        outcome="dead" if decision.dead else "retry",
        error=ran.error,
        message=message,
        retry_in=None if decision.dead else decision.delay,
    )


def sweep_steps(batch: int) -> Generator[Step, Any, list[TaskFailure]]:
    """Expire queued tasks past their TTL, then settle up to ``batch`` expired leases.

    One transaction: the lapsed rows stay locked from the SELECT to their fenced UPDATE.
    """
    expired = yield Sql(query("task_expire_queued"), {"batch": batch})
    changes = [typed_row(TaskFailure, row._mapping) for row in expired]
    lapsed = yield Sql(query("task_lapsed_leases"), {"batch": batch})
    for row in lapsed:
        decision = after_lease_expiry(
            policy=row.policy,
            attempt=row.attempt,
            max_attempts=row.max_attempts,
            past_ttl=row.past_ttl,
            owner=row.lease_owner,
        )
        settled = yield Sql(
            query("task_settle_lapsed"),
            {
                "id": row.task_id,
                "attempt": row.attempt,
                "status": decision.status,
                "reason": error_text(decision.reason),
                "finished": decision.finished,
            },
        )
        if settled:
            outcome = "requeued" if decision.status == "queued" else decision.status
            changes.append(
                typed_row(TaskFailure, row._mapping, outcome=outcome, error=decision.reason)
            )
    return changes


def _record(row: sa.Row[Any]) -> TaskRecord:
    return TaskRecord.from_row(row._mapping)


#: The states ``task_reclaim`` queues again.
RECLAIMABLE = ("stale", "dead", "failed")


def _not_reclaimable(task_id: UUID, found: Sequence[sa.Row[Any]]) -> TaskError:
    if not found:
        return TaskNotFoundError(f"no task has id {task_id}")
    return NotReclaimableError(
        f"task {task_id} is {found[0].status}: only a stale, dead or failed task can be reclaimed"
    )


def reclaim_steps(task_id: UUID) -> Generator[Step, Any, TaskRecord]:
    reclaimed = yield Sql(query("task_reclaim"), {"id": task_id})
    if reclaimed:
        return _record(reclaimed[0])
    found = yield Sql(query("task_get"), {"id": task_id})
    raise _not_reclaimable(task_id, found)


def reclaimable_steps(task_id: UUID) -> Generator[Step, Any, TaskRecord]:
    found = yield Sql(query("task_get"), {"id": task_id})
    if not found or found[0].status not in RECLAIMABLE:
        raise _not_reclaimable(task_id, found)
    return _record(found[0])


def _rows(statement: str, params: Mapping[str, Any]) -> Generator[Step, Any, list[sa.Row[Any]]]:
    rows: list[sa.Row[Any]] = yield Sql(query(statement), params)
    return rows


class TaskStore:
    """``oncely_tasks`` on a sync ``Engine``: lease, settle, renew, sweep, purge, reclaim, list.

    Tasks it leases can renew their lease (``task.renew_lease()``) for ``lease_seconds``.

    Each method is one short transaction. Settles and renewals raise :class:`LeaseLostError` when
    the fence refuses them; :meth:`reclaim` raises :class:`TaskNotFoundError` or
    :class:`NotReclaimableError`; database errors propagate.
    """

    def __init__(
        self,
        *,
        engine: sa.Engine,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        backoff: Backoff | None = None,
        tracing: Tracing = _TRACING,
    ) -> None:
        self.engine = engine
        self.lease_seconds = lease_seconds
        self.backoff = backoff or DEFAULT_BACKOFF
        self.tracing = tracing

    def lease(self, owner: str, names: Iterable[str]) -> Task | None:
        """Lease the oldest due task named in ``names`` for ``lease_seconds``, or ``None``."""
        return drive(
            self.engine, lease_steps(lease_sql(owner, names, self.lease_seconds), self.renew)
        )

    def run(self, lease: Sql, handler: TaskHandler) -> Attempt | None:
        """Lease with ``lease``, run ``handler`` and settle (see :func:`attempt_steps`)."""
        return drive(
            self.engine,
            attempt_steps(
                lease, handler, backoff=self.backoff, renewer=self.renew, tracing=self.tracing
            ),
        )

    def complete(self, task: Task) -> None:
        """Mark the attempt completed; :class:`LeaseLostError` if the fence refuses it."""
        drive(self.engine, complete_steps(task))

    def fail(self, task: Task, error: BaseException | str) -> FailureDecision:
        """Record a failed attempt: retry after the backoff, or dead after the last attempt."""
        message = error if isinstance(error, str) else error_text(error)
        return drive(self.engine, fail_steps(task, message, self.backoff))

    def renew(self, task: Task) -> datetime:
        """Extend an irreversible task's lease by ``lease_seconds`` from now."""
        return drive(self.engine, renew_steps(task, self.lease_seconds))

    def sweep(self, batch: int = SWEEP_BATCH) -> list[TaskFailure]:
        """Apply TTLs and expired leases (see :mod:`.rules`); return what changed."""
        return drive(self.engine, sweep_steps(batch))

    def purge(self, retention_seconds: float, batch: int = PURGE_BATCH) -> int:
        """Delete terminal tasks finished over ``retention_seconds`` ago, ``batch`` at a time."""
        params = {"retention_seconds": float(retention_seconds)}
        return purge_in_batches(self.engine, "task_purge", params, batch_size=batch)

    def reclaim(self, task_id: UUID) -> TaskRecord:
        """Queue a stale, dead or failed task again, due now (an operator's decision)."""
        return drive(self.engine, reclaim_steps(task_id))

    def reclaimable(self, task_id: UUID) -> TaskRecord:
        """The task :meth:`reclaim` would queue again, as it is now; changes nothing.

        Raises :class:`TaskNotFoundError` or :class:`NotReclaimableError` as :meth:`reclaim` would.
        """
        return drive(self.engine, reclaimable_steps(task_id))

    def get(self, task_id: UUID) -> TaskRecord | None:
        """The task ``task_id``, or ``None`` when there is no such row."""
        rows = drive(self.engine, _rows("task_get", {"id": task_id}))
        return _record(rows[0]) if rows else None

    def list_tasks(self, *, status: str | None = None, limit: int = 50) -> list[TaskRecord]:
        """The newest ``limit`` tasks, optionally only those in ``status``."""
        rows = drive(self.engine, _rows("task_list", {"status": status, "limit": limit}))
        return [_record(row) for row in rows]

    def of_event(self, event_id: UUID, *, limit: int = 50) -> list[TaskRecord]:
        """The tasks effects queued for ``event_id`` under their default key
        (``<effect>:<event id>:<name>``), oldest first."""
        rows = drive(self.engine, _rows("lookup_tasks", {"id": str(event_id), "limit": limit}))
        return [_record(row) for row in rows]

    def waiting_names(self) -> list[str]:
        """Names of queued or leased tasks: each needs a handler before a worker starts."""
        return [row.name for row in drive(self.engine, _rows("task_names_waiting", {}))]


def count_by_status(conn: sa.Connection) -> dict[str, int]:
    """How many tasks are in each status (every status, zero when none), on the caller's
    connection (``oncely status`` reads it in one snapshot with the other tables)."""
    counts = dict.fromkeys(TASK_STATUSES, 0)
    counts.update(
        {row.status: int(row.tasks) for row in conn.execute(query("ops_tasks_by_status"))}
    )
    return counts
