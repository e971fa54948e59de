"""The payments example's durable event types: the life of a transfer.

A transfer is requested, then either completes or fails. Every event is keyed by its
``transfer_id``, so all events of one transfer keep their order on their topic. The committed
contract of these types is ``schemas/`` at the repository root (``oncely schemas export``).
"""

from __future__ import annotations

from decimal import Decimal
from enum import StrEnum
from typing import Annotated
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from oncely.events import Registry

registry = Registry(topic_prefix="payments.")

Money = Annotated[Decimal, Field(max_digits=18, decimal_places=2, gt=0)]
Fee = Annotated[Decimal, Field(max_digits=18, decimal_places=2, ge=0)]
Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$", description="ISO 4217 code, e.g. EUR.")]
AccountId = Annotated[str, Field(min_length=1, max_length=64)]


class FailureReason(StrEnum):
    """Why a transfer did not go through."""

    INSUFFICIENT_FUNDS = "insufficient_funds"
    ACCOUNT_CLOSED = "account_closed"
    LIMIT_EXCEEDED = "limit_exceeded"
    REJECTED = "rejected"


class PaymentEvent(BaseModel):
    """Events are facts: immutable once created."""

    model_config = ConfigDict(frozen=True)


@registry.event("transfer.requested", key="transfer_id", aggregate="transfer")
class TransferRequested(PaymentEvent):
    """A customer asked to move money from one account to another."""

    transfer_id: UUID
    from_account: AccountId
    to_account: AccountId
    amount: Money
    currency: Currency
    requested_at: AwareDatetime
    reference: str | None = Field(default=None, description="Shown on both statements.")


@registry.event("transfer.completed", key="transfer_id", aggregate="transfer", version=2)
class TransferCompleted(PaymentEvent):
    """The money moved: both accounts are booked."""

    transfer_id: UUID
    from_account: AccountId
    to_account: AccountId
    amount: Money
    currency: Currency
    completed_at: AwareDatetime
    fee: Fee | None = Field(default=None, description="Charged to the sender; since v2.")


@registry.event("transfer.failed", key="transfer_id", aggregate="transfer")
class TransferFailed(PaymentEvent):
    """The transfer was refused; no account was booked."""

    transfer_id: UUID
    from_account: AccountId
    to_account: AccountId
    amount: Money
    currency: Currency
    reason: FailureReason
    detail: str | None = Field(default=None, description="Human-readable detail of the refusal.")
    failed_at: AwareDatetime
