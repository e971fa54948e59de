"""A fake email provider that behaves like a real one: it de-duplicates by idempotency key.

Every call is counted (``calls``) but an email is sent once per key, the way providers that
accept an ``Idempotency-Key`` behave. The demo checks that each key was called exactly once.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from examples.payments.models import provider_emails


class FakeEmailProvider:
    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def send(self, *, idempotency_key: str, recipient: str, subject: str) -> None:
        """Send (once per key) and count the call."""
        statement = insert(provider_emails).values(
            idempotency_key=idempotency_key, recipient=recipient, subject=subject, calls=1
        )
        statement = statement.on_conflict_do_update(
            index_elements=[provider_emails.c.idempotency_key],
            set_={"calls": provider_emails.c.calls + 1},
        )
        with self.engine.begin() as conn:
            conn.execute(statement)
