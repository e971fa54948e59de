"""Races between processes on real PostgreSQL: workers leasing side by side, and a durable
command's immediate delivery against a worker woken by its commit. Every task runs once."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.producer.commands import DurableCommand, PostCommitResult, PostCommitTask
from oncely.settings import TaskSettings
from oncely.tasks import Task, Tasks, TaskWorker, enqueue_task

pytestmark = pytest.mark.integration

TASKS = 60


def _record(url: str, task: Task, by: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO provider_calls (idempotency_key, attempt, by) VALUES (:k, :a, :b)"
            ),
            {"k": task.idempotency_key, "a": task.attempt, "b": by},
        )
    engine.dispose()


def _worker(url: str, barrier: Any, done: Any) -> None:
    engine = sa.create_engine(url)
    tasks = Tasks()
    tasks.handler("race.run")(lambda task: _record(url, task, "worker"))
    worker = TaskWorker(engine=engine, tasks=tasks, settings=TaskSettings())
    barrier.wait()
    while True:
        finished = done.is_set()  # read first: nothing is enqueued once it is set
        if worker.dispatch_pending(limit=TASKS) == 0:
            if finished:
                break
            time.sleep(0.01)
    engine.dispose()


def _commands(url: str, barrier: Any, done: Any) -> None:
    engine = sa.create_engine(url)
    command = DurableCommand(engine=engine)
    barrier.wait()
    for n in range(TASKS):
        effect = PostCommitTask(
            name="race.run",
            payload={"n": n},
            deliver=lambda task: _record(url, task, "command"),
        )
        result: PostCommitResult[None] = command.execute(lambda session: None, tasks=[effect])
        assert result.business_committed
    done.set()
    engine.dispose()


def _calls(url: str) -> list[tuple[str, int, str]]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT idempotency_key, attempt, by FROM provider_calls"))
        calls = [(row[0], row[1], row[2]) for row in rows]
    engine.dispose()
    return calls


def _setup(url: str) -> sa.Engine:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE provider_calls (idempotency_key text, attempt int, by text)")
        )
    return engine


def _run(targets: list[Any], url: str, *, all_enqueued: bool) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(targets))
    done = context.Event()
    if all_enqueued:
        done.set()
    processes = [context.Process(target=t, args=(url, barrier, done)) for t in targets]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0


def test_three_workers_run_each_task_exactly_once(database_url: str) -> None:
    engine = _setup(database_url)
    with Session(engine) as session, session.begin():
        ids = {str(enqueue_task(session, "race.run", {"n": n}).id) for n in range(TASKS)}
    engine.dispose()
    _run([_worker, _worker, _worker], database_url, all_enqueued=True)
    calls = _calls(database_url)
    assert sorted(key for key, _, _ in calls) == sorted(ids)
    assert {attempt for _, attempt, _ in calls} == {1}


def test_immediate_deliveries_and_a_worker_never_run_a_task_twice(database_url: str) -> None:
    _setup(database_url).dispose()
    _run([_commands, _worker], database_url, all_enqueued=False)
    calls = _calls(database_url)
    keys = [key for key, _, _ in calls]
    assert len(keys) == TASKS
    assert len(set(keys)) == TASKS
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        statuses = conn.execute(sa.text("SELECT status, count(*) FROM oncely_tasks GROUP BY 1"))
        assert dict(statuses.all()) == {"completed": TASKS}  # type: ignore[arg-type]
    engine.dispose()
