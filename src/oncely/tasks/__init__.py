"""Durable local tasks: effects outside the database (an email, a webhook, an API call) that
must happen after a commit, once, with retries (seeds 001, 003 and 004).

Enqueue in the business transaction with :func:`enqueue_task`; register handlers on a
:class:`Tasks` app; run them with ``oncely tasks run myapp.tasks:tasks`` (:class:`TaskWorker`).
The states and decisions are in :mod:`.rules`; the statements in ``storage/sql/tasks.sql``.
"""

from oncely.tasks.app import Tasks
from oncely.tasks.enqueue import enqueue_task
from oncely.tasks.errors import (
    LeaseLost,
    MissingHandlerError,
    NotReclaimable,
    TaskError,
    TaskNotFound,
)
from oncely.tasks.model import (
    Attempt,
    Handler,
    Observer,
    QueuedTask,
    Task,
    TaskFailure,
    TaskRecord,
)
from oncely.tasks.rules import Backoff, Policy, default_task_key
from oncely.tasks.store import TaskStore
from oncely.tasks.worker import TaskWorker

__all__ = [
    "Attempt",
    "Backoff",
    "Handler",
    "LeaseLost",
    "MissingHandlerError",
    "NotReclaimable",
    "Observer",
    "Policy",
    "QueuedTask",
    "Task",
    "TaskError",
    "TaskFailure",
    "TaskNotFound",
    "TaskRecord",
    "TaskStore",
    "TaskWorker",
    "Tasks",
    "default_task_key",
    "enqueue_task",
]
