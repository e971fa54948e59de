"""The orders service's durable event type: ``order.placed``, keyed by the order id."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

import oncely

registry = oncely.Registry(topic_prefix="storefront.")

Money = Annotated[Decimal, Field(max_digits=12, decimal_places=2, gt=0)]
Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$", description="ISO 4217 code, e.g. EUR.")]


@registry.event("order.placed", key="order_id", aggregate="order")
class OrderPlaced(BaseModel):
    """A customer placed an order; it is stored and will not change."""

    model_config = ConfigDict(frozen=True)

    order_id: UUID
    customer_email: str
    total: Money
    currency: Currency
    placed_at: AwareDatetime
