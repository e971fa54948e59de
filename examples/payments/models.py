"""The payments example's own tables: transfers, a ledger projection, and a fake email provider.

``ledger_entries`` has no unique constraint on the event: if a receipt failed to keep an effect
single, the duplicate would show here (the demo's invariants look for one).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

transfers = sa.Table(
    "transfers",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("from_account", sa.Text, nullable=False),
    sa.Column("to_account", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(18, 2), nullable=False),
    sa.Column("currency", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("request_key", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)

ledger_entries = sa.Table(
    "ledger_entries",
    metadata,
    sa.Column("event_id", sa.Uuid, nullable=False),
    sa.Column("transfer_id", sa.Uuid, nullable=False),
    sa.Column("account", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(18, 2), nullable=False),
    sa.Column("booked_at", sa.DateTime(timezone=True), server_default=sa.func.clock_timestamp()),
)

provider_emails = sa.Table(
    "provider_emails",
    metadata,
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("recipient", sa.Text, nullable=False),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("calls", sa.Integer, nullable=False),
    sa.Column("sent_at", sa.DateTime(timezone=True), server_default=sa.func.clock_timestamp()),
)
