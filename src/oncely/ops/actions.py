"""What an operator may change, each operation with its dry run and its audit entry: requeue or
skip parked rows, reclaim a task, republish a window.

The CLI (``oncely dead``, ``oncely tasks reclaim``, ``oncely replay --from-outbox``) and the
console (``oncely web``) both call these, never their own copies. ``plan_*`` changes nothing
and shows what the operation would change now; the operation itself writes its
:class:`~oncely.storage.stores.audit.Entry` in the transaction that carries it out, so the log
holds exactly the operations that took effect (``republish`` sends records to Kafka, outside
any transaction: its entry is written once every record was delivered).
"""

from __future__ import annotations

import getpass
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from oncely.ops.republish import RepublishPlan, Tally, republish
from oncely.relay.publisher import Publisher
from oncely.runtime.steps import Sql, Step, drive
from oncely.storage.stores import audit
from oncely.storage.stores.outbox import dead
from oncely.storage.stores.outbox.dead import ChangedRow, DeadRow
from oncely.tasks.model import TaskRecord
from oncely.tasks.store import TaskStore, reclaim_steps


@dataclass(frozen=True, slots=True)
class Operator:
    """Who asks: a console user (``via="web"``) or the command line's OS user (``"cli"``)."""

    name: str
    via: audit.Via

    @classmethod
    def of_cli(cls) -> Operator:
        """The OS user running the command."""
        return cls(getpass.getuser(), "cli")


def _named(ids: Sequence[UUID] | None, topic: str | None) -> str:
    if ids:
        return "rows " + ", ".join(map(str, ids))
    return f"the dead rows of topic {topic}" if topic is not None else "every dead row"


def plan_requeue(
    engine: sa.Engine, *, ids: Sequence[UUID] | None = None, topic: str | None = None
) -> list[DeadRow]:
    """The parked rows :func:`requeue` would ask to publish again now; changes nothing."""
    return dead.matching_dead(engine, ids=ids, topic=topic)


def requeue(
    engine: sa.Engine,
    *,
    operator: Operator,
    reason: str = "",
    ids: Sequence[UUID] | None = None,
    topic: str | None = None,
) -> list[ChangedRow]:
    """Ask the relay to publish again the dead or delayed rows named by ``ids``, or the dead
    rows of ``topic``, or every dead row, then the rows held behind their keys (see
    :func:`oncely.storage.stores.outbox.dead.requeue`); audited with the rows it changed."""
    with engine.begin() as conn:
        rows = dead.requeue(conn, ids=ids, topic=topic)
        audit.record(
            conn,
            audit.Entry(
                operator.name, operator.via, "requeue", _named(ids, topic), len(rows), reason
            ),
        )
    return rows


def plan_skip(engine: sa.Engine, *, ids: Sequence[UUID]) -> list[DeadRow]:
    """The parked rows :func:`skip` would give up; changes nothing."""
    return dead.matching_dead(engine, ids=ids)


def skip(
    engine: sa.Engine, *, operator: Operator, ids: Sequence[UUID], reason: str = ""
) -> list[ChangedRow]:
    """Ask the relay to give up the named dead or delayed rows (never published): the rows held
    behind their keys go out without them; audited with the rows it changed."""
    with engine.begin() as conn:
        rows = dead.skip(conn, ids=ids)
        audit.record(
            conn,
            audit.Entry(operator.name, operator.via, "skip", _named(ids, None), len(rows), reason),
        )
    return rows


def plan_reclaim(engine: sa.Engine, task_id: UUID) -> TaskRecord:
    """The task :func:`reclaim` would queue again, as it is now; raises as :func:`reclaim`
    does."""
    return TaskStore(engine=engine).reclaimable(task_id)


def reclaim(
    engine: sa.Engine, task_id: UUID, *, operator: Operator, reason: str = ""
) -> TaskRecord:
    """Queue a stale, dead or failed task again, due now; audited in the same transaction.

    Raises :class:`~oncely.tasks.errors.TaskNotFoundError` or
    :class:`~oncely.tasks.errors.NotReclaimableError` (nothing changes, nothing is audited).
    """
    entry = audit.Entry(operator.name, operator.via, "reclaim", f"task {task_id}", 1, reason)
    return drive(engine, _audited(reclaim_steps(task_id), entry))


def _audited(
    steps: Generator[Step, Any, TaskRecord], entry: audit.Entry
) -> Generator[Step, Any, TaskRecord]:
    """``steps``, then ``entry`` written by the statement after them, in their transaction."""
    record = yield from steps
    yield Sql(*audit.insert(entry))
    return record


def republish_window(
    engine: sa.Engine,
    *,
    operator: Operator,
    publisher: Publisher,
    since: datetime,
    until: datetime | None,
    event_type: str | None,
    reason: str = "",
    progress: Tally | None = None,
) -> RepublishPlan:
    """Send the window's rows to Kafka again (:func:`oncely.ops.republish.republish`, which
    :func:`oncely.ops.republish.plan_republish` previews), then audit it. Raises as
    ``republish`` does; a window that failed is not audited (nothing in the database changed)."""
    plan = republish(
        engine,
        publisher=publisher,
        since=since,
        until=until,
        event_type=event_type,
        progress=progress,
    )
    window = f"rows created since {since.isoformat()}"
    if until is not None:
        window += f" until {until.isoformat()}"
    if event_type is not None:
        window += f" of type {event_type}"
    with engine.begin() as conn:
        audit.record(
            conn, audit.Entry(operator.name, operator.via, "republish", window, plan.rows, reason)
        )
    return plan
