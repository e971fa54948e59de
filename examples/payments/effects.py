"""The payments example's effects, each its own consumer group.

- ``send-receipt``: email the sender a receipt. Email is outside the database, so the effect
  only queues an ``email.send`` task in the receipt's transaction; the task worker sends it
  with a stable idempotency key (``examples.payments.tasks``).
- ``ledger-projection``: book the transfer on both accounts of the ledger projection.

Run them with ``oncely consume examples.payments.effects:effects --effect send-receipt``.
"""

from __future__ import annotations

import sqlalchemy as sa

import oncely
from examples.payments.events import TransferCompleted, registry
from examples.payments.models import ledger_entries

effects = oncely.Effects(registry, group_prefix="payments.")


@effects.effect("send-receipt", on=TransferCompleted)
def send_receipt(event: TransferCompleted, ctx: oncely.EffectContext) -> None:
    ctx.enqueue_task(
        "email.send",
        {
            "to": f"{event.from_account}@example.test",
            "subject": f"You sent {event.amount} {event.currency} to {event.to_account}",
        },
    )


@effects.effect("ledger-projection", on=TransferCompleted)
def project_ledger(event: TransferCompleted, ctx: oncely.EffectContext) -> None:
    ctx.session.execute(
        sa.insert(ledger_entries),
        [
            {
                "event_id": ctx.event_id,
                "transfer_id": event.transfer_id,
                "account": event.from_account,
                "amount": -event.amount,
            },
            {
                "event_id": ctx.event_id,
                "transfer_id": event.transfer_id,
                "account": event.to_account,
                "amount": event.amount,
            },
        ],
    )
