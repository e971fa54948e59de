"""`oncely tasks run|list|reclaim` in subprocesses: workers killed mid-task (SIGKILL), graceful
SIGTERM, the start-up check, and the operator's commands. The fake provider of
:mod:`tests.acceptance.task_app` records every call, so each test counts attempts per key."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.devstack._process import free_port
from oncely.tasks import enqueue_task
from tests.helpers import execute, http_get, metric, oncely_process, query_all, scalar, start_oncely

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.task_app:tasks"
RUN = ("tasks", "run", APP, "--lease-seconds", "1")


class _Workers:
    """Worker processes started by a test, stopped (killed if need be) at its end."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url = url
        self.logs = logs
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        log = (self.logs / f"worker-{len(self.started)}.log").open("wb")
        process = start_oncely(
            *RUN,
            *("--poll-seconds", "0.2", *args),
            cwd=ROOT,
            env={"ONCELY_DATABASE_URL": self.url},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    execute(
        engine,
        "CREATE TABLE provider_calls ("
        " idempotency_key text NOT NULL, attempt integer NOT NULL,"
        " pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    yield engine
    engine.dispose()


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[_Workers]:
    started = _Workers(database_url, tmp_path)
    yield started
    started.stop_all()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return oncely_process(
        "tasks", *args, cwd=ROOT, env={"ONCELY_DATABASE_URL": url, "COLUMNS": "250"}, timeout=60
    )


def _enqueue(engine: sa.Engine, name: str, payload: dict[str, Any], **kwargs: Any) -> uuid.UUID:
    with Session(engine) as session, session.begin():
        return enqueue_task(session, name, payload, **kwargs).id


def _calls(engine: sa.Engine) -> list[tuple[str, int, int]]:
    rows = query_all(engine, "SELECT idempotency_key, attempt, pid FROM provider_calls ORDER BY at")
    return [tuple(row) for row in rows]  # type: ignore[misc]


def _status(engine: sa.Engine, task_id: uuid.UUID) -> str:
    return str(scalar(engine, "SELECT status FROM oncely_tasks WHERE id = :id", id=task_id))


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kill_mid_task(engine: sa.Engine, workers: _Workers) -> subprocess.Popen[str]:
    first = workers.start()
    _wait_for(lambda: len(_calls(engine)) == 1, "the first attempt to start")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    return first


def test_a_retry_safe_task_of_a_killed_worker_is_rerun_by_another_after_the_lease(
    engine: sa.Engine, workers: _Workers
) -> None:
    task_id = _enqueue(engine, "fake.retry_safe", {"block_on_attempt": 1})
    killed = _kill_mid_task(engine, workers)
    assert _status(engine, task_id) == "leased"
    survivor = workers.start()
    _wait_for(lambda: _status(engine, task_id) == "completed", "the re-run")
    calls = _calls(engine)
    assert [(key, attempt) for key, attempt, _ in calls] == [(str(task_id), 1), (str(task_id), 2)]
    assert [pid for *_, pid in calls] == [killed.pid, survivor.pid]
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=15) == 0


def test_an_irreversible_task_of_a_killed_worker_is_stale_until_reclaimed(
    database_url: str, engine: sa.Engine, workers: _Workers
) -> None:
    task_id = _enqueue(engine, "fake.irreversible", {"block_on_attempt": 1}, policy="irreversible")
    _kill_mid_task(engine, workers)
    workers.start()
    _wait_for(lambda: _status(engine, task_id) == "stale", "the sweep to mark it stale")
    time.sleep(1.5)  # several more sweeps and polls: it is never re-run by itself
    assert _status(engine, task_id) == "stale"
    assert [attempt for _, attempt, _ in _calls(engine)] == [1]

    listed = _cli(database_url, "list", "--state", "stale")
    assert listed.returncode == 0, listed.stderr
    assert str(task_id) in listed.stdout
    assert "fake.irreversible" in listed.stdout
    assert "Z" in listed.stdout  # ISO-8601 UTC timestamps
    assert "1 task(s)" in listed.stdout

    dry_run = _cli(database_url, "reclaim", str(task_id))
    assert dry_run.returncode == 0, dry_run.stderr
    assert f"would reclaim task {task_id} (fake.irreversible" in dry_run.stdout
    assert "stale after 1 attempt(s)" in dry_run.stdout
    assert "run again with --yes" in dry_run.stdout
    time.sleep(1.0)  # sweeps and polls: the dry run queued nothing
    assert _status(engine, task_id) == "stale"
    reclaimed = _cli(database_url, "reclaim", str(task_id), "--yes")
    assert reclaimed.returncode == 0, reclaimed.stderr
    assert f"reclaimed task {task_id}" in reclaimed.stdout
    _wait_for(lambda: _status(engine, task_id) == "completed", "the reclaimed task to run")
    assert _calls(engine)[1][:2] == (str(task_id), 2)  # same idempotency key, attempt 2


def test_sigterm_finishes_the_current_task_then_exits_0(
    engine: sa.Engine, workers: _Workers
) -> None:
    task_id = _enqueue(engine, "fake.retry_safe", {"seconds": 1.5})
    worker = workers.start("--lease-seconds", "30")
    _wait_for(lambda: len(_calls(engine)) == 1, "the task to start")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0
    assert _status(engine, task_id) == "completed"
    assert scalar(engine, "SELECT count(*) FROM oncely_tasks WHERE status = 'leased'") == 0


def test_the_worker_serves_metrics_and_health_like_the_relay_and_consumers(
    engine: sa.Engine, workers: _Workers
) -> None:
    port = free_port()
    worker = workers.start("--metrics-port", str(port))
    _wait_for(lambda: _answers(port, "/readyz") == 200, "the worker to be ready")
    assert http_get(port, "/healthz")[0] == 200
    ids = [_enqueue(engine, "fake.retry_safe", {"n": n}) for n in range(3)]
    _wait_for(lambda: all(_status(engine, i) == "completed" for i in ids), "the tasks to run")
    completed = 'oncely_tasks_attempts_total{name="fake.retry_safe",outcome="completed"}'
    _wait_for(lambda: metric(port, completed) == 3, "the attempts to be counted")
    assert metric(port, "oncely_tasks_purged_total") == 0
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0


def _answers(port: int, path: str) -> int | None:
    try:
        return http_get(port, path)[0]
    except OSError:
        return None


def test_the_worker_refuses_to_start_without_a_handler(
    database_url: str, engine: sa.Engine
) -> None:
    _enqueue(engine, "fake.retry_safe", {})
    _enqueue(engine, "invoice.send", {})
    result = _cli(database_url, "run", APP)
    assert result.returncode == 2
    assert "refusing to start" in result.stderr
    assert "'invoice.send'" in result.stderr
    assert "fake.retry_safe" not in result.stderr
    assert _calls(engine) == []


def test_bad_targets_and_arguments_exit_2_and_unknown_tasks_exit_1(database_url: str) -> None:
    not_an_app = _cli(database_url, "run", "oncely.tasks:TaskWorker")
    assert (not_an_app.returncode, "name an oncely.App" in not_an_app.stderr) == (2, True)
    missing = _cli(database_url, "run", "no_such_module:tasks")
    assert (missing.returncode, "cannot import module" in missing.stderr) == (2, True)
    bad_state = _cli(database_url, "list", "--state", "sleeping")
    assert (bad_state.returncode, "unknown state" in bad_state.stderr) == (2, True)
    not_an_id = _cli(database_url, "reclaim", "nope")
    assert (not_an_id.returncode, "not a task id" in not_an_id.stderr) == (2, True)
    unknown = _cli(database_url, "reclaim", str(uuid.uuid4()))
    assert (unknown.returncode, "no task has id" in unknown.stderr) == (1, True)
    unknown = _cli(database_url, "reclaim", str(uuid.uuid4()), "--yes")
    assert (unknown.returncode, "no task has id" in unknown.stderr) == (1, True)
