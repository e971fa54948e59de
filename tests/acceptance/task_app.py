"""A task app for the CLI tests, with a fake provider that records every call in the database.

``provider_calls`` (created by the test) gets one row per call: the task's idempotency key,
the attempt and the worker's pid. A payload may ask the handler to block on one attempt (so the
test can kill the worker mid-task) or to take some seconds.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

from oncely.tasks import Task, Tasks

tasks = Tasks()
_engines: dict[str, sa.Engine] = {}


def _provider(task: Task) -> None:
    url = os.environ["ONCELY_DATABASE_URL"]
    engine = _engines.get(url) or _engines.setdefault(url, sa.create_engine(url))
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO provider_calls (idempotency_key, attempt, pid)"
                " VALUES (:key, :attempt, :pid)"
            ),
            {"key": task.idempotency_key, "attempt": task.attempt, "pid": os.getpid()},
        )
    if task.payload.get("block_on_attempt") == task.attempt:
        time.sleep(3600)
    time.sleep(float(task.payload.get("seconds", 0)))


@tasks.handler("fake.retry_safe")
def retry_safe(task: Task) -> None:
    _provider(task)


@tasks.handler("fake.irreversible")
def irreversible(task: Task) -> None:
    _provider(task)
