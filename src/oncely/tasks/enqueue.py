"""``enqueue_task()``: add a durable task inside the caller's own transaction.

The task row is written through the caller's ``Session``, ``AsyncSession`` or ``Connection``
and commits or rolls back with the business rows: there is no commit here. With a ``Session``
or a ``Connection`` it is inserted at once; with an ``AsyncSession`` it joins the unit of work
and is inserted at the next flush, so the call does no I/O (:mod:`oncely.storage.transactional`,
as ``stage()``). The active OpenTelemetry context is stored with it: the
worker's span for the task continues that trace (:mod:`oncely.runtime.tracing`). An insert
trigger notifies ``oncely_tasks`` at commit, so an idle worker wakes immediately.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from oncely.runtime.tracing import current_context_text
from oncely.storage.tables import TASK_POLICIES, TRACE_CONTEXT_COLUMN
from oncely.storage.transactional import Transactional
from oncely.tasks.model import QueuedTask
from oncely.tasks.rules import (
    DEFAULT_MAX_ATTEMPTS,
    Policy,
    canonical_json,
    default_task_key,
)
from oncely.tasks.store import add_task


def _db_now_plus(delay: timedelta) -> sa.ColumnElement[datetime]:
    """``now() + delay`` evaluated by PostgreSQL (the database clock), at insert time."""
    return sa.func.now() + sa.literal(delay, sa.Interval())


def enqueue_task(
    target: Transactional,
    name: str,
    payload: Mapping[str, Any],
    *,
    policy: Policy = "retry_safe",
    task_key: str | None = None,
    ttl: timedelta | None = None,
    max_attempts: int | None = None,
    available_at: datetime | timedelta | None = None,
) -> QueuedTask:
    """Add a task to ``oncely_tasks`` in the caller's transaction; a worker runs it after commit.

    Args:
        target: the caller's ``Session``, ``AsyncSession`` or ``Connection``, inside the
            business transaction. Nothing is committed here.
        name: the handler's name (``@tasks.handler(name)``).
        payload: a JSON object given to the handler as ``task.payload``.
        policy: ``"retry_safe"`` (an expired lease re-runs it) or ``"irreversible"`` (an
            expired lease makes it ``stale`` until an operator reclaims it).
        task_key: unique key of the task; by default ``<name>:<hash of the canonical JSON
            payload>``, so the same (name, payload) is one task (see
            :func:`~oncely.tasks.rules.default_task_key`).
        ttl: the task expires (never runs again) this long after the transaction started.
        max_attempts: attempts before it is ``dead`` (default 5).
        available_at: not before this time (a ``timedelta``: after the database's ``now()``).

    Raises:
        ValueError: an empty name, an unknown policy, ``max_attempts < 1`` or a payload that is
            not a JSON object.
        DuplicateInTransactionError: the key was already enqueued in this transaction.
        DuplicateTaskKeyError: an earlier transaction enqueued the key (at once with a
            ``Session`` or ``Connection``, at flush or commit with an ``AsyncSession``).
    """
    if not name:
        raise ValueError("a task needs a name")
    if policy not in TASK_POLICIES:
        raise ValueError(f"task policy must be one of {TASK_POLICIES}, not {policy!r}")
    attempts = DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts
    if attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, not {attempts}")
    if not isinstance(payload, Mapping):
        raise ValueError(f"the payload of task {name!r} must be a JSON object")
    try:
        canonical_json(payload)
    except TypeError as exc:
        raise ValueError(f"the payload of task {name!r} is not JSON: {exc}") from exc
    key = task_key if task_key is not None else default_task_key(name, payload)
    row: dict[str, Any] = {
        "id": uuid.uuid4(),
        "task_key": key,
        "name": name,
        "payload": dict(payload),
        "policy": policy,
        "max_attempts": attempts,
    }
    trace_context = current_context_text()
    if trace_context is not None:
        row[TRACE_CONTEXT_COLUMN] = trace_context
    if ttl is not None:
        row["expires_at"] = _db_now_plus(ttl)
    if isinstance(available_at, timedelta):
        row["available_at"] = _db_now_plus(available_at)
    elif available_at is not None:
        row["available_at"] = available_at
    add_task(target, row)
    return QueuedTask(id=row["id"], task_key=key, name=name)
