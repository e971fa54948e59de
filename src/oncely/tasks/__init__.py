"""Durable local tasks: effects outside the database (an email, a webhook, an API call) that
must happen after a commit, once, with retries.

Enqueue in the business transaction with :func:`enqueue_task`; register handlers on a
:class:`Tasks` app; run them with ``oncely tasks run myapp.tasks:tasks`` (:class:`TaskWorker`).
The states and decisions are in :mod:`.rules`; the statements in ``storage/sql/tasks.sql``.
"""

from oncely.runtime.retry import Backoff
from oncely.tasks.app import Tasks
from oncely.tasks.enqueue import enqueue_task
from oncely.tasks.errors import (
    LeaseLostError,
    MissingHandlerError,
    NotReclaimableError,
    TaskError,
    TaskNotFoundError,
)
from oncely.tasks.model import (
    Attempt,
    Observer,
    QueuedTask,
    Renewer,
    Task,
    TaskFailure,
    TaskHandler,
    TaskRecord,
)
from oncely.tasks.rules import DEFAULT_BACKOFF, Policy, default_task_key
from oncely.tasks.store import DEFAULT_LEASE_SECONDS, TaskStore, deliver_steps
from oncely.tasks.worker import TaskWorker, run_worker

__all__ = [
    "DEFAULT_BACKOFF",
    "DEFAULT_LEASE_SECONDS",
    "Attempt",
    "Backoff",
    "LeaseLostError",
    "MissingHandlerError",
    "NotReclaimableError",
    "Observer",
    "Policy",
    "QueuedTask",
    "Renewer",
    "Task",
    "TaskError",
    "TaskFailure",
    "TaskHandler",
    "TaskNotFoundError",
    "TaskRecord",
    "TaskStore",
    "TaskWorker",
    "Tasks",
    "default_task_key",
    "deliver_steps",
    "enqueue_task",
    "run_worker",
]
