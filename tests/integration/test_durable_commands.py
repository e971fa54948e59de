"""On real PostgreSQL: durable commands commit business writes and tasks together,
deliver the immediate ones after the commit with fenced settles, and leave the rest to the
worker. Every rule runs through the sync and the async command."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, registry

from oncely.producer.commands import (
    AsyncDurableCommand,
    DurableCommand,
    PostCommitResult,
    PostCommitTask,
    PostCommitTaskError,
)
from oncely.settings import TaskSettings
from oncely.storage import DuplicateTaskKeyError
from oncely.storage.transactional import DuplicateInTransactionError
from oncely.tasks import LeaseLostError, Task, TaskError, Tasks, TaskStore, TaskWorker
from oncely.tasks.rules import NOT_CONFIRMED, Backoff

pytestmark = pytest.mark.integration

_orders = sa.Table(
    "orders",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("note", sa.Text),
)


class Order:
    def __init__(self, id: int, note: str = "") -> None:
        self.id = id
        self.note = note


registry().map_imperatively(Order, _orders)

Business = Callable[[Session | AsyncSession], Any]


class _Command:
    """The sync or the async command behind one blocking interface."""

    def __init__(self, url: str, *, use_async: bool) -> None:
        self.url = url
        self.use_async = use_async

    def execute(self, business: Business, effects: Any = (), **options: Any) -> Any:
        if not self.use_async:
            engine = sa.create_engine(self.url)
            try:
                return DurableCommand(engine=engine, **options).execute(business, tasks=effects)
            finally:
                engine.dispose()

        async def stage(session: AsyncSession) -> Any:
            return business(session)

        async def main() -> Any:
            engine = create_async_engine(self.url)
            try:
                command = AsyncDurableCommand(engine=engine, **options)
                return await command.execute(stage, tasks=effects)
            finally:
                await engine.dispose()

        return asyncio.run(main())


@pytest.fixture(params=["sync", "async"])
def command(request: pytest.FixtureRequest, database_url: str) -> _Command:
    return _Command(database_url, use_async=request.param == "async")


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    _orders.create(engine)
    yield engine
    engine.dispose()


def _place(order_id: int) -> Business:
    def business(session: Session | AsyncSession) -> int:
        session.add(Order(order_id, "placed"))
        return order_id

    return business


def _tasks(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM oncely_tasks ORDER BY task_key"))
        return [dict(row._mapping) for row in rows]


def _orders_in(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(_orders.c.id).order_by(_orders.c.id)).scalars())


class _Provider:
    """A fake external provider: the attempts it saw, by idempotency key."""

    def __init__(self, result: Any = None, error: Exception | None = None) -> None:
        self.result = result
        self.error = error
        self.calls: dict[str, list[int]] = {}

    def __call__(self, task: Task) -> Any:
        self.calls.setdefault(task.idempotency_key, []).append(task.attempt)
        if self.error is not None:
            raise self.error
        return self.result


def test_a_business_error_commits_nothing(command: _Command, engine: sa.Engine) -> None:
    provider = _Provider()

    def business(session: Session | AsyncSession) -> None:
        session.add(Order(1))
        raise RuntimeError("insufficient funds")

    effect = PostCommitTask(name="receipt.send", payload={"order": 1}, deliver=provider)
    with pytest.raises(RuntimeError, match="insufficient funds"):
        command.execute(business, [effect])
    assert (_orders_in(engine), _tasks(engine), provider.calls) == ([], [], {})


def test_duplicate_task_keys_in_one_transaction_commit_nothing(
    command: _Command, engine: sa.Engine
) -> None:
    effects = [
        PostCommitTask(name="receipt.send", payload={"order": 1}, task_key="receipt-1"),
        PostCommitTask(name="receipt.mail", payload={"order": 1}, task_key="receipt-1"),
    ]
    with pytest.raises(DuplicateInTransactionError, match="receipt-1"):
        command.execute(_place(1), effects)
    assert (_orders_in(engine), _tasks(engine)) == ([], [])


def test_a_key_enqueued_by_an_earlier_transaction_commits_nothing(
    command: _Command, engine: sa.Engine
) -> None:
    effect = PostCommitTask(name="receipt.send", payload={"order": 1}, task_key="receipt-1")
    command.execute(_place(1), [effect])
    with pytest.raises(DuplicateTaskKeyError, match="already exists"):
        command.execute(_place(2), [effect])
    assert _orders_in(engine) == [1]
    assert len(_tasks(engine)) == 1


def test_an_immediate_delivery_completes_the_task(command: _Command, engine: sa.Engine) -> None:
    provider = _Provider(result=True)
    effects = [
        PostCommitTask(
            name="receipt.send", payload={"order": 7}, task_key="a-receipt", deliver=provider
        ),
        PostCommitTask(name="audit.write", payload={"order": 7}, task_key="b-audit"),
    ]
    result = command.execute(_place(7), effects)
    assert result == PostCommitResult(
        value=7,
        business_committed=True,
        completed_tasks=("a-receipt",),
        pending_tasks=("b-audit",),
    )
    receipt, audit = _tasks(engine)
    assert (receipt["status"], receipt["attempts"]) == ("completed", 1)
    assert provider.calls == {str(receipt["id"]): [1]}
    assert (audit["status"], audit["attempts"]) == ("queued", 0)
    assert _orders_in(engine) == [7]


def test_effects_can_depend_on_the_business_value(command: _Command, engine: sa.Engine) -> None:
    provider = _Provider()

    def effects(order_id: int) -> list[PostCommitTask]:
        return [PostCommitTask(name="receipt.send", payload={"order": order_id}, deliver=provider)]

    result = command.execute(_place(9), effects)
    [task] = _tasks(engine)
    assert task["payload"] == {"order": 9}
    assert result.completed_tasks == (task["task_key"],)


def test_a_failed_delivery_is_committed_pending_and_raised_with_the_result(
    command: _Command, engine: sa.Engine
) -> None:
    provider = _Provider(error=ConnectionError("smtp down"))
    effect = PostCommitTask(name="receipt.send", payload={"order": 3}, deliver=provider)
    with pytest.raises(PostCommitTaskError, match="committed; 1 immediate") as info:
        command.execute(_place(3), [effect])
    [task] = _tasks(engine)
    result = info.value.result
    assert (result.value, result.business_committed) == (3, True)
    assert (result.completed_tasks, result.pending_tasks) == ((), (task["task_key"],))
    assert [type(e) for e in info.value.errors] == [ConnectionError]
    assert (task["status"], task["attempts"]) == ("queued", 1)
    assert task["last_error"] == "ConnectionError: smtp down"
    assert _orders_in(engine) == [3]


def test_an_unconfirmed_delivery_schedules_a_retry(command: _Command, engine: sa.Engine) -> None:
    provider = _Provider(result=False)
    effect = PostCommitTask(name="receipt.send", payload={"order": 4}, deliver=provider)
    result = command.execute(_place(4), [effect])
    [task] = _tasks(engine)
    assert (result.completed_tasks, result.pending_tasks) == ((), (task["task_key"],))
    assert (task["status"], task["attempts"], task["last_error"]) == ("queued", 1, NOT_CONFIRMED)
    assert task["available_at"] > task["created_at"]


def test_a_settle_after_the_lease_was_lost_raises_lease_lost(
    command: _Command, engine: sa.Engine
) -> None:
    def deliver(task: Task) -> None:
        with engine.begin() as conn:  # the lease runs out while the provider is slow
            conn.execute(
                sa.text(
                    "UPDATE oncely_tasks SET lease_until = now() - interval '1 second'"
                    " WHERE id = :id"
                ),
                {"id": task.id},
            )

    effect = PostCommitTask(name="receipt.send", payload={"order": 5}, deliver=deliver)
    with pytest.raises(PostCommitTaskError) as info:
        command.execute(_place(5), [effect])
    [lost] = info.value.errors
    assert isinstance(lost, LeaseLostError)
    [task] = _tasks(engine)
    assert info.value.result.pending_tasks == (task["task_key"],)
    assert (task["status"], task["attempts"]) == ("leased", 1)  # for the sweep to decide


def test_the_worker_finishes_what_the_immediate_path_left_pending(
    command: _Command, engine: sa.Engine
) -> None:
    failing = _Provider(error=TimeoutError("provider timed out"))
    effects = [
        PostCommitTask(name="receipt.send", payload={"order": 6}, task_key="r-6", deliver=failing),
        PostCommitTask(
            name="receipt.send", payload={"order": 6, "copy": True}, task_key="r-6-copy"
        ),
    ]
    with pytest.raises(PostCommitTaskError):
        command.execute(_place(6), effects, backoff=Backoff(first=0, maximum=0))
    tasks = Tasks()
    provider = _Provider(result=True)
    tasks.handler("receipt.send")(provider)
    assert (
        TaskWorker(engine=engine, tasks=tasks, settings=TaskSettings()).dispatch_pending(limit=10)
        == 2
    )
    first, copy = _tasks(engine)
    assert (first["status"], first["attempts"]) == ("completed", 2)
    assert (copy["status"], copy["attempts"]) == ("completed", 1)
    assert provider.calls == {str(first["id"]): [2], str(copy["id"]): [1]}
    assert failing.calls == {str(first["id"]): [1]}


def test_a_task_leased_by_a_worker_first_is_left_pending(
    command: _Command, engine: sa.Engine
) -> None:
    second = _Provider()

    def first(task: Task) -> None:
        # A worker woken by the commit leases the second task before the command gets to it.
        assert TaskStore(engine=engine).lease("a-worker", ["audit.write"]) is not None

    effects = [
        PostCommitTask(name="receipt.send", payload={}, task_key="a", deliver=first),
        PostCommitTask(name="audit.write", payload={}, task_key="b", deliver=second),
        PostCommitTask(
            name="audit.later", payload={}, task_key="c", available_at=timedelta(hours=1)
        ),
    ]
    result = command.execute(_place(8), effects)
    assert (result.completed_tasks, result.pending_tasks) == (("a",), ("b", "c"))
    assert second.calls == {}
    assert [(t["task_key"], t["status"], t["lease_owner"]) for t in _tasks(engine)] == [
        ("a", "completed", None),
        ("b", "leased", "a-worker"),
        ("c", "queued", None),
    ]


def test_an_async_deliver_is_awaited(database_url: str, engine: sa.Engine) -> None:
    seen: list[int] = []

    async def deliver(task: Task) -> bool:
        await asyncio.sleep(0)
        seen.append(task.attempt)
        with pytest.raises(TaskError, match="cannot be renewed in an async"):
            task.renew_lease()
        return True

    async def main() -> PostCommitResult[int]:
        async_engine = create_async_engine(database_url)
        try:
            command = AsyncDurableCommand(engine=async_engine)

            async def stage(session: AsyncSession) -> int:
                session.add(Order(11))
                return 11

            effect = PostCommitTask(
                name="order.place",
                payload={"order": 11},
                policy="irreversible",
                task_key="o-11",
                deliver=deliver,
            )
            return await command.execute(stage, tasks=[effect])
        finally:
            await async_engine.dispose()

    result = asyncio.run(main())
    assert (result.completed_tasks, seen) == (("o-11",), [1])
