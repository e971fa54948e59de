"""The payments service: one function that moves money, safe to call twice with the same key.

The transfer row and its events commit together (``oncely.stage`` in the same transaction), and
the request is de-duplicated by its idempotency key: a client that retries gets the first
answer back instead of a second transfer.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import oncely
from examples.payments.events import (
    FailureReason,
    TransferCompleted,
    TransferFailed,
    TransferRequested,
)
from examples.payments.models import transfers

LIMIT = Decimal("5000.00")


class TransferService:
    """Moves money between accounts; every transfer is announced by its events."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.keys = oncely.IdempotencyKeys(engine)

    def request_transfer(
        self,
        *,
        idempotency_key: str,
        from_account: str,
        to_account: str,
        amount: Decimal,
        currency: str = "EUR",
    ) -> dict[str, Any]:
        """Book a transfer once per idempotency key and return ``{"transfer_id", "status"}``.

        A repeated key returns the first result with ``"duplicate": True``. Raises
        ``oncely.IdempotencyBusyError`` while the first request is still running,
        ``oncely.IdempotencyMismatchError`` if the key was used for a different request.
        """
        request = {"from": from_account, "to": to_account, "amount": str(amount), "cur": currency}
        fingerprint = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
        claim = self.keys.claim("payments-api", idempotency_key, fingerprint=fingerprint)
        if claim.previous is not None:
            return {**claim.previous["result"], "duplicate": True}
        if claim.reclaimed:
            # The first attempt died after claiming: if it committed the transfer, answer with it.
            done = self._booked(idempotency_key)
            if done is not None:
                self.keys.finish("payments-api", idempotency_key, "accepted", result=done)
                return done
        transfer_id = uuid.uuid4()
        now = datetime.now(UTC)
        status = "completed" if amount <= LIMIT else "failed"
        with Session(self.engine) as session, session.begin():
            session.execute(
                sa.insert(transfers).values(
                    id=transfer_id,
                    from_account=from_account,
                    to_account=to_account,
                    amount=amount,
                    currency=currency,
                    status=status,
                    request_key=idempotency_key,
                )
            )
            common = {
                "transfer_id": transfer_id,
                "from_account": from_account,
                "to_account": to_account,
                "amount": amount,
                "currency": currency,
            }
            outcome: TransferCompleted | TransferFailed
            if status == "completed":
                outcome = TransferCompleted(**common, completed_at=now)
            else:
                outcome = TransferFailed(
                    **common, reason=FailureReason.LIMIT_EXCEEDED, failed_at=now
                )
            oncely.stage_many(session, [TransferRequested(**common, requested_at=now), outcome])
        result = {"transfer_id": str(transfer_id), "status": status}
        self.keys.finish("payments-api", idempotency_key, "accepted", result=result)
        return result

    def _booked(self, idempotency_key: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(transfers.c.id, transfers.c.status).where(
                    transfers.c.request_key == idempotency_key
                )
            ).first()
        return None if row is None else {"transfer_id": str(row.id), "status": row.status}
