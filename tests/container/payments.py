"""What the payments example's containers have applied, read from its tables."""

from __future__ import annotations

import sqlalchemy as sa
from examples.payments.models import ledger_entries, provider_emails


def applied(engine: sa.Engine) -> tuple[int, int]:
    """(ledger entries, provider emails): the effects' rows and the task's."""
    with engine.connect() as conn:
        ledger = conn.scalar(sa.select(sa.func.count()).select_from(ledger_entries))
        emails = conn.scalar(sa.select(sa.func.count()).select_from(provider_emails))
    return int(ledger or 0), int(emails or 0)
