"""The payments example's local tasks: ``email.send``, delivered through the fake provider.

Run them with ``oncely tasks run examples.payments.tasks:tasks`` (``ONCELY_DATABASE_URL`` names
the database the provider writes to).
"""

from __future__ import annotations

import os
from functools import cache

import sqlalchemy as sa

import oncely
from examples.payments.provider import FakeEmailProvider

tasks = oncely.Tasks(required=["email.send"])


@cache
def _provider() -> FakeEmailProvider:
    return FakeEmailProvider(sa.create_engine(os.environ["ONCELY_DATABASE_URL"]))


@tasks.handler("email.send")
def send_email(task: oncely.Task) -> None:
    _provider().send(
        idempotency_key=task.idempotency_key,
        recipient=task.payload["to"],
        subject=task.payload["subject"],
    )
