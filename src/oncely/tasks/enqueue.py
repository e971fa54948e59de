"""``enqueue_task()``: add a durable task inside the caller's own transaction.

The task row is written through the caller's ``Session``, ``AsyncSession`` or ``Connection``
and commits or rolls back with the business rows: there is no commit here. With a session the
row is added to the unit of work (inserted at the next flush, no I/O now); with a
``Connection`` it is inserted at once. The active OpenTelemetry context is stored with it: the
worker's span for the task continues that trace (:mod:`oncely.runtime.tracing`). An insert
trigger notifies ``oncely_tasks`` at commit, so an idle worker wakes immediately.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, registry

from oncely.runtime.tracing import current_context_text
from oncely.storage.errors import DuplicateTaskKeyError, translate_errors_of
from oncely.storage.tables import TASK_POLICIES, TRACE_CONTEXT_COLUMN, tasks
from oncely.tasks.model import QueuedTask
from oncely.tasks.rules import (
    DEFAULT_MAX_ATTEMPTS,
    Policy,
    canonical_json,
    default_task_key,
)

Transactional = Session | AsyncSession | sa.Connection
"""What ``enqueue_task()`` writes through: the caller's session or connection."""


class _TaskRow:
    """ORM mapping of ``oncely_tasks`` so sessions can ``add`` rows without I/O."""

    def __init__(self, **columns: Any) -> None:
        self.__dict__.update(columns)


registry().map_imperatively(_TaskRow, tasks)


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
        DuplicateTaskKeyError: the key was already enqueued in this session's pending rows
            (now), or by an earlier transaction (at the insert: at once with a ``Connection``,
            at flush or commit with a session).
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
    # A duplicate task_key found by the database (at flush, commit or a Connection's insert)
    # is raised as DuplicateTaskKeyError.
    translate_errors_of(target)
    if isinstance(target, sa.Connection):
        target.execute(sa.insert(tasks).values(row))
    else:
        session = target.sync_session if isinstance(target, AsyncSession) else target
        if any(
            isinstance(pending, _TaskRow) and pending.__dict__.get("task_key") == key
            for pending in session.new
        ):
            raise DuplicateTaskKeyError(
                f"task key {key!r} is enqueued twice in one transaction; give each task its "
                "own task_key"
            )
        session.add(_TaskRow(**row))
    return QueuedTask(id=row["id"], task_key=key, name=name)
