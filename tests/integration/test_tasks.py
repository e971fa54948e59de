"""Durable tasks on real PostgreSQL: enqueue, the worker's settle and fences, and every lease-expiry
rule (lease expiry by policy, renewal, TTL, late results, retention purge)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from oncely.errors import ConfigurationError
from oncely.settings import TaskSettings
from oncely.storage import DuplicateTaskKeyError
from oncely.storage.transactional import DuplicateInTransactionError
from oncely.tasks import (
    LeaseLostError,
    MissingHandlerError,
    NotReclaimableError,
    Task,
    TaskFailure,
    TaskNotFoundError,
    Tasks,
    TaskStore,
    TaskWorker,
    enqueue_task,
)
from oncely.tasks.rules import NOT_CONFIRMED
from oncely.testing.services import libpq_dsn

pytestmark = pytest.mark.integration


def _enqueue(engine: sa.Engine, name: str, payload: dict[str, Any], **kwargs: Any) -> uuid.UUID:
    with Session(engine) as session, session.begin():
        return enqueue_task(session, name, payload, **kwargs).id


def _row(engine: sa.Engine, task_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM oncely_tasks WHERE id = :id"), {"id": task_id})
        return dict(row.one()._mapping)


def _sql(engine: sa.Engine, statement: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(statement), params)


def _lapse(engine: sa.Engine, task_id: uuid.UUID) -> None:
    """Let the task's lease run out (on the database clock) without waiting for it."""
    _sql(
        engine,
        "UPDATE oncely_tasks SET lease_until = now() - interval '1 second' WHERE id = :id",
        id=task_id,
    )


def _make_due(engine: sa.Engine, task_id: uuid.UUID) -> None:
    _sql(engine, "UPDATE oncely_tasks SET available_at = now() WHERE id = :id", id=task_id)


class _Calls:
    """A fake provider: what each handler was called with, by idempotency key."""

    def __init__(self) -> None:
        self.by_key: dict[str, list[int]] = {}

    def record(self, task: Task) -> None:
        self.by_key.setdefault(task.idempotency_key, []).append(task.attempt)


def _app(calls: _Calls, result: Any = None, error: Exception | None = None) -> Tasks:
    tasks = Tasks()

    @tasks.handler("email.send")
    def send(task: Task) -> Any:
        calls.record(task)
        if error is not None:
            raise error
        return result

    return tasks


# -- enqueue ---------------------------------------------------------------------------------


@pytest.mark.parametrize("through", ["session", "async_session", "connection"])
def test_enqueue_commits_and_rolls_back_with_the_caller(
    database_url: str, engine: sa.Engine, through: str
) -> None:
    def enqueue(target: Any, key: str, fail: bool) -> None:
        enqueue_task(target, "email.send", {"to": key}, task_key=key)
        if fail:
            raise RuntimeError("business failed")

    for key, fail in (("kept", False), ("rolled-back", True)):
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            if through == "session":
                with Session(engine) as session, session.begin():
                    enqueue(session, key, fail)
            elif through == "connection":
                with engine.begin() as conn:
                    enqueue(conn, key, fail)
            else:

                async def main(key: str = key, fail: bool = fail) -> None:
                    async_engine = create_async_engine(database_url)
                    try:
                        async with AsyncSession(async_engine) as session, session.begin():
                            enqueue(session, key, fail)
                    finally:
                        await async_engine.dispose()

                asyncio.run(main())
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT task_key, status, attempts FROM oncely_tasks")).all()
    assert [tuple(row) for row in rows] == [("kept", "queued", 0)]


def test_the_default_key_makes_the_same_task_once(engine: sa.Engine) -> None:
    first = _enqueue(engine, "email.send", {"to": "a@example.com", "template": "welcome"})
    row = _row(engine, first)
    assert row["task_key"].startswith("email.send:")
    assert (row["policy"], row["max_attempts"], row["expires_at"]) == ("retry_safe", 5, None)
    with pytest.raises(DuplicateTaskKeyError, match="already exists"):
        _enqueue(engine, "email.send", {"template": "welcome", "to": "a@example.com"})
    # Twice in one transaction is refused at once, before any I/O, as stage() refuses a key.
    with Session(engine) as session, session.begin():
        enqueue_task(session, "email.send", {"to": "b@example.com"})
        with pytest.raises(DuplicateInTransactionError, match="twice in one transaction"):
            enqueue_task(session, "email.send", {"to": "b@example.com"})
    # On a connection the same rule holds, before the database would refuse the second.
    with engine.begin() as conn:
        enqueue_task(conn, "email.send", {"to": "c@example.com"})
        with pytest.raises(DuplicateInTransactionError, match=r"task key 'email\.send:"):
            enqueue_task(conn, "email.send", {"to": "c@example.com"})
    # A key an earlier transaction used: the database refuses it, at once.
    with pytest.raises(DuplicateTaskKeyError), engine.begin() as conn:
        enqueue_task(conn, "email.send", {"to": "a@example.com", "template": "welcome"})


def test_ttl_and_delay_use_the_database_clock(engine: sa.Engine) -> None:
    task_id = _enqueue(
        engine,
        "email.send",
        {},
        policy="irreversible",
        ttl=timedelta(minutes=5),
        available_at=timedelta(seconds=30),
        max_attempts=2,
    )
    row = _row(engine, task_id)
    assert row["expires_at"] - row["created_at"] == timedelta(minutes=5)
    assert row["available_at"] - row["created_at"] == timedelta(seconds=30)
    assert (row["policy"], row["max_attempts"]) == ("irreversible", 2)
    # Not due yet: nobody leases it.
    assert TaskStore(engine=engine).lease("w", ["email.send"]) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "sometimes"}, "policy"),
        ({"max_attempts": 0}, "at least 1"),
        ({"payload": {"at": object()}}, "not JSON"),
        ({"payload": ["a"]}, "JSON object"),
    ],
)
def test_enqueue_refuses_bad_arguments(engine: sa.Engine, kwargs: Any, message: str) -> None:
    payload = kwargs.pop("payload", {})
    with Session(engine) as session, pytest.raises(ValueError, match=message):
        enqueue_task(session, "email.send", payload, **kwargs)


def test_an_insert_notifies_listening_workers_at_commit(
    database_url: str, engine: sa.Engine
) -> None:
    with psycopg.connect(libpq_dsn(database_url), autocommit=True) as listener:
        listener.execute("LISTEN oncely_tasks")
        with engine.begin() as conn:
            enqueue_task(conn, "email.send", {"n": 1})
            enqueue_task(conn, "email.send", {"n": 2})
        received = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.channel for n in received] == ["oncely_tasks"]


# -- the worker: start-up check, settle, retry, dead ------------------------------------------


def test_the_worker_refuses_to_start_without_a_handler_for_a_waiting_name(
    engine: sa.Engine,
) -> None:
    _enqueue(engine, "webhook.post", {})
    _enqueue(engine, "sms.send", {})
    done = _enqueue(engine, "legacy.fax", {})
    _sql(engine, "UPDATE oncely_tasks SET status = 'completed' WHERE id = :id", id=done)
    worker = TaskWorker(engine=engine, tasks=_app(_Calls()), settings=TaskSettings())
    with pytest.raises(MissingHandlerError, match=r"'sms\.send', 'webhook\.post'") as info:
        worker.run()
    assert info.value.names == ("sms.send", "webhook.post")
    required = TaskWorker(
        engine=engine, tasks=Tasks(required={"email.send"}), settings=TaskSettings()
    )
    with pytest.raises(MissingHandlerError, match=r"email\.send"):
        required.check()


def test_a_worker_only_leases_names_it_has_handlers_for(engine: sa.Engine) -> None:
    other = _enqueue(engine, "webhook.post", {})
    calls = _Calls()
    mine = _enqueue(engine, "email.send", {})
    worker = TaskWorker(engine=engine, tasks=_app(calls), settings=TaskSettings())
    assert worker.dispatch_pending(limit=10) == 1
    assert _row(engine, mine)["status"] == "completed"
    assert _row(engine, other)["status"] == "queued"


def test_a_completed_task_ran_once_with_a_stable_idempotency_key(engine: sa.Engine) -> None:
    calls = _Calls()
    task_id = _enqueue(engine, "email.send", {"to": "a@example.com"})
    worker = TaskWorker(engine=engine, tasks=_app(calls, result=True), settings=TaskSettings())
    attempt = worker.run_once()
    assert attempt is not None
    assert attempt.outcome == "completed"
    assert calls.by_key == {str(task_id): [1]}
    row = _row(engine, task_id)
    assert (row["status"], row["attempts"], row["lease_owner"]) == ("completed", 1, None)
    assert row["finished_at"] is not None
    assert worker.run_once() is None


def test_failures_retry_with_backoff_then_go_dead_and_are_observed(engine: sa.Engine) -> None:
    calls = _Calls()
    seen: list[TaskFailure] = []
    task_id = _enqueue(engine, "email.send", {}, max_attempts=3)
    worker = TaskWorker(
        engine=engine,
        tasks=_app(calls, error=RuntimeError("x" * 5000)),
        settings=TaskSettings(),
        observer=seen.append,
    )
    for expected in ("retry", "retry", "dead"):
        attempt = worker.run_once()
        assert attempt is not None
        assert attempt.outcome == expected
        _make_due(engine, task_id)
    assert calls.by_key == {str(task_id): [1, 2, 3]}
    row = _row(engine, task_id)
    assert (row["status"], row["attempts"]) == ("dead", 3)
    assert row["last_error"] == ("RuntimeError: " + "x" * 5000)[:4000]
    assert [(f.outcome, f.attempt, f.retry_in, f.dead_letter) for f in seen] == [
        ("retry", 1, 1.0, False),
        ("retry", 2, 2.0, False),
        ("dead", 3, None, True),
    ]


def test_a_retry_waits_for_its_backoff_on_the_database_clock(engine: sa.Engine) -> None:
    task_id = _enqueue(engine, "email.send", {})
    worker = TaskWorker(engine=engine, tasks=_app(_Calls(), result=False), settings=TaskSettings())
    attempt = worker.run_once()
    assert attempt is not None
    assert (attempt.outcome, attempt.message, attempt.retry_in) == ("retry", NOT_CONFIRMED, 1.0)
    row = _row(engine, task_id)
    assert (row["status"], row["attempts"], row["last_error"]) == ("queued", 1, NOT_CONFIRMED)
    assert worker.run_once() is None  # due in one second
    time.sleep(1.1)
    attempt = worker.run_once()
    assert attempt is not None
    assert attempt.task.attempt == 2


def test_an_observer_that_fails_does_not_stop_the_worker(engine: sa.Engine) -> None:
    def broken(failure: TaskFailure) -> None:
        raise RuntimeError("metrics are down")

    _enqueue(engine, "email.send", {})
    worker = TaskWorker(
        engine=engine, tasks=_app(_Calls(), result=False), settings=TaskSettings(), observer=broken
    )
    attempt = worker.run_once()
    assert attempt is not None
    assert attempt.outcome == "retry"


def test_an_async_handler_runs_to_completion_in_the_sync_worker(engine: sa.Engine) -> None:
    tasks = Tasks()
    seen: list[int] = []

    @tasks.handler("email.send")
    async def send(task: Task) -> bool:
        await asyncio.sleep(0)
        seen.append(task.attempt)
        return True

    task_id = _enqueue(engine, "email.send", {})
    assert TaskWorker(engine=engine, tasks=tasks, settings=TaskSettings()).dispatch_pending() == 1
    assert (seen, _row(engine, task_id)["status"]) == ([1], "completed")


# -- fences: a lost lease never reports success -----------------------------------------------


def _leased_by_worker_a_and_lapsed(engine: sa.Engine) -> tuple[TaskStore, Task]:
    """A new task leased by worker-a whose lease then ran out, and the store that leased it."""
    task_id = _enqueue(engine, "email.send", {})
    store = TaskStore(engine=engine, lease_seconds=30)
    task = store.lease("worker-a", ["email.send"])
    assert task is not None
    assert task.id == task_id
    _lapse(engine, task_id)
    return store, task


def test_a_late_result_is_refused(engine: sa.Engine) -> None:
    store, task = _leased_by_worker_a_and_lapsed(engine)
    with pytest.raises(LeaseLostError, match="success is not recorded"):
        store.complete(task)
    with pytest.raises(LeaseLostError, match="failure is not recorded"):
        store.fail(task, RuntimeError("late"))
    row = _row(engine, task.id)
    assert (row["status"], row["last_error"], row["lease_owner"]) == ("leased", None, "worker-a")


def test_a_settle_with_a_stale_attempt_is_refused_after_a_newer_lease(engine: sa.Engine) -> None:
    store, old = _leased_by_worker_a_and_lapsed(engine)
    assert [c.outcome for c in store.sweep()] == ["requeued"]
    new = store.lease("worker-b", ["email.send"])
    assert new is not None
    assert new.attempt == 2
    with pytest.raises(LeaseLostError):
        store.complete(old)
    # Even the same owner cannot settle an older attempt.
    stale_attempt = Task(**{**vars(new), "attempt": 1})
    with pytest.raises(LeaseLostError):
        store.complete(stale_attempt)
    store.complete(new)
    assert _row(engine, old.id)["status"] == "completed"


def test_a_worker_counts_a_lost_lease_and_never_reports_success(engine: sa.Engine) -> None:
    tasks = Tasks()
    seen: list[TaskFailure] = []

    @tasks.handler("email.send")
    def slow(task: Task) -> None:
        _lapse(engine, task.id)  # the lease runs out while the handler works

    task_id = _enqueue(engine, "email.send", {})
    worker = TaskWorker(engine=engine, tasks=tasks, settings=TaskSettings(), observer=seen.append)
    attempt = worker.run_once()
    assert attempt is not None
    assert attempt.outcome == "lease_lost"
    assert isinstance(attempt.error, LeaseLostError)
    assert [f.outcome for f in seen] == ["lease_lost"]
    assert _row(engine, task_id)["status"] == "leased"
    assert [c.outcome for c in worker.sweep()] == ["requeued"]


# -- lease expiry by policy, renewal, TTL, retention --------------------------------


def test_a_retry_safe_lease_expiry_runs_the_task_again(engine: sa.Engine) -> None:
    calls = _Calls()
    task_id = _enqueue(engine, "email.send", {})
    first = TaskStore(engine=engine, lease_seconds=0.5).lease("crashed", ["email.send"])
    assert first is not None
    time.sleep(0.6)  # the real lease runs out on the database clock
    worker = TaskWorker(engine=engine, tasks=_app(calls), settings=TaskSettings())
    assert worker.dispatch_pending() == 1
    assert calls.by_key == {str(task_id): [2]}
    row = _row(engine, task_id)
    assert (row["status"], row["attempts"]) == ("completed", 2)
    assert "the lease of crashed on attempt 1 expired" in row["last_error"]


def test_an_irreversible_lease_expiry_is_stale_until_reclaimed(engine: sa.Engine) -> None:
    calls = _Calls()
    seen: list[TaskFailure] = []
    task_id = _enqueue(engine, "email.send", {}, policy="irreversible")
    first = TaskStore(engine=engine).lease("crashed", ["email.send"])
    assert first is not None
    _lapse(engine, task_id)
    worker = TaskWorker(
        engine=engine, tasks=_app(calls), settings=TaskSettings(), observer=seen.append
    )
    assert worker.dispatch_pending() == 0
    assert worker.dispatch_pending() == 0
    assert calls.by_key == {}
    row = _row(engine, task_id)
    assert (row["status"], row["lease_owner"], row["finished_at"]) == ("stale", None, None)
    assert "oncely tasks reclaim" in row["last_error"]
    assert [(f.outcome, f.dead_letter) for f in seen] == [("stale", True)]
    # An operator checked the provider and reclaims it: it runs again, with the same key.
    previewed = worker.store.reclaimable(task_id)  # the dry run changes nothing
    assert (previewed.status, previewed.attempts) == ("stale", 1)
    assert _row(engine, task_id)["status"] == "stale"
    reclaimed = worker.store.reclaim(task_id)
    assert (reclaimed.status, reclaimed.attempts) == ("queued", 1)
    assert worker.dispatch_pending() == 1
    assert calls.by_key == {str(task_id): [2]}
    assert _row(engine, task_id)["status"] == "completed"


def test_reclaim_refuses_unknown_and_live_tasks(engine: sa.Engine) -> None:
    store = TaskStore(engine=engine)
    with pytest.raises(TaskNotFoundError):
        store.reclaim(uuid.uuid4())
    with pytest.raises(TaskNotFoundError):
        store.reclaimable(uuid.uuid4())
    task_id = _enqueue(engine, "email.send", {})
    with pytest.raises(NotReclaimableError, match="is queued"):
        store.reclaim(task_id)
    with pytest.raises(NotReclaimableError, match="is queued"):
        store.reclaimable(task_id)


def test_renewal_keeps_an_irreversible_task_leased(engine: sa.Engine) -> None:
    tasks = Tasks()
    sweeps: list[list[TaskFailure]] = []
    sweeper = TaskStore(engine=engine)

    @tasks.handler("order.place")
    def place(task: Task) -> None:
        # Work twice as long as the lease, renewing; another worker sweeps meanwhile.
        for _ in range(5):
            time.sleep(0.4)
            task.renew_lease()
            sweeps.append(sweeper.sweep())

    task_id = _enqueue(engine, "order.place", {}, policy="irreversible")
    worker = TaskWorker(engine=engine, tasks=tasks, settings=TaskSettings(lease_seconds=1))
    attempt = worker.run_once()
    assert attempt is not None
    assert attempt.outcome == "completed"
    assert sweeps == [[]] * 5
    assert (_row(engine, task_id)["status"], _row(engine, task_id)["attempts"]) == ("completed", 1)


def test_renewal_is_refused_for_retry_safe_tasks_and_lost_leases(engine: sa.Engine) -> None:
    retry_safe = _enqueue(engine, "email.send", {})
    irreversible = _enqueue(engine, "order.place", {}, policy="irreversible")
    store = TaskStore(engine=engine)
    task = store.lease("w", ["email.send"])
    assert task is not None
    assert task.id == retry_safe
    with pytest.raises(ConfigurationError, match="retry-safe"):
        task.renew_lease()
    order = store.lease("w", ["order.place"])
    assert order is not None
    before = order.lease_until
    assert order.renew_lease() > before
    _lapse(engine, irreversible)
    with pytest.raises(LeaseLostError, match="cannot be renewed"):
        order.renew_lease()


def test_the_ttl_wins_over_requeueing(engine: sa.Engine) -> None:
    calls = _Calls()
    leased = _enqueue(engine, "email.send", {"n": 1}, ttl=timedelta(seconds=30))
    store = TaskStore(engine=engine)
    assert store.lease("crashed", ["email.send"]) is not None
    queued = _enqueue(engine, "email.send", {"n": 2}, ttl=timedelta(seconds=30))
    _sql(engine, "UPDATE oncely_tasks SET expires_at = now() - interval '1 second'")
    _lapse(engine, leased)
    worker = TaskWorker(engine=engine, tasks=_app(calls), settings=TaskSettings())
    assert worker.dispatch_pending() == 0
    assert calls.by_key == {}
    for task_id in (leased, queued):
        row = _row(engine, task_id)
        assert row["status"] == "expired"
        assert row["finished_at"] is not None
    assert "TTL has passed" in _row(engine, leased)["last_error"]
    assert "TTL passed before the task ran" in _row(engine, queued)["last_error"]


def test_a_retry_safe_task_leased_max_attempts_times_fails(engine: sa.Engine) -> None:
    task_id = _enqueue(engine, "email.send", {}, max_attempts=2)
    store = TaskStore(engine=engine)
    for expected in ("requeued", "failed"):
        assert store.lease("crashing", ["email.send"]) is not None
        _lapse(engine, task_id)
        assert [change.outcome for change in store.sweep()] == [expected]
    row = _row(engine, task_id)
    assert (row["status"], row["last_error"]) == ("failed", "leased 2 times without a result")


def test_terminal_tasks_past_the_retention_are_purged_in_batches(engine: sa.Engine) -> None:
    for n in range(5):
        _enqueue(engine, "email.send", {"old": n})
    recent = _enqueue(engine, "email.send", {"recent": True})
    stale = _enqueue(engine, "email.send", {"stale": True}, policy="irreversible")
    queued = _enqueue(engine, "email.send", {"queued": True})
    _sql(
        engine,
        "UPDATE oncely_tasks SET status = 'completed', finished_at = now() - interval '2 days'"
        " WHERE payload ? 'old'",
    )
    _sql(
        engine,
        "UPDATE oncely_tasks SET status = 'dead', finished_at = now() WHERE id = :id",
        id=recent,
    )
    _sql(
        engine,
        "UPDATE oncely_tasks SET status = 'stale', created_at = now() - interval '9 days'"
        " WHERE id = :id",
        id=stale,
    )
    store = TaskStore(engine=engine)
    assert store.purge(retention_seconds=86400, batch=2) == 5
    assert store.purge(retention_seconds=86400, batch=2) == 0
    with engine.connect() as conn:
        left = set(conn.execute(sa.text("SELECT id FROM oncely_tasks")).scalars())
    assert left == {recent, stale, queued}
    worker = TaskWorker(
        engine=engine, tasks=_app(_Calls()), settings=TaskSettings(retention_seconds=0)
    )
    assert worker.purge() == 1  # the dead one; stale and queued tasks are never purged


def test_list_shows_the_newest_tasks_by_state(engine: sa.Engine) -> None:
    first = _enqueue(engine, "email.send", {"n": 1})
    second = _enqueue(engine, "email.send", {"n": 2})
    _sql(engine, "UPDATE oncely_tasks SET status = 'dead' WHERE id = :id", id=first)
    store = TaskStore(engine=engine)
    assert [r.id for r in store.list_tasks()] == [second, first]
    assert [r.id for r in store.list_tasks(status="dead")] == [first]
    assert store.get(second) is not None
    assert store.get(uuid.uuid4()) is None


# -- the run loop: LISTEN wake-up and stop ----------------------------------------------------


def test_the_running_worker_wakes_on_notify_and_stops_after_its_task(engine: sa.Engine) -> None:
    calls = _Calls()
    worker = TaskWorker(
        engine=engine, tasks=_app(calls), settings=TaskSettings(poll_interval_seconds=30)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        time.sleep(0.5)  # idle, waiting for a notification for up to 30 s
        started = time.monotonic()
        task_id = _enqueue(engine, "email.send", {})
        while _row(engine, task_id)["status"] != "completed":
            assert time.monotonic() - started < 5, "the worker did not wake up"
            time.sleep(0.05)
        assert time.monotonic() - started < 5
    finally:
        worker.stop()
        _enqueue(engine, "email.send", {"wake": "up"})  # wakes the idle wait at once
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert calls.by_key[str(task_id)] == [1]
