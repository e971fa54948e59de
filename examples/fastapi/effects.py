"""The orders service's effect: ``order-history``, an ``async def`` handler.

It runs in its own consumer group (``storefront.order-history``) on an ``AsyncSession``, in the
transaction that inserts its receipt: the history row and the receipt commit together, so a
redelivered ``order.placed`` adds nothing. ``ctx.insert`` collects the row; the consumer writes
the rows of a whole batch in one statement.
"""

from __future__ import annotations

import oncely
from examples.fastapi.events import OrderPlaced, registry
from examples.fastapi.models import OrderHistory

effects = oncely.Effects(registry, group_prefix="storefront.")


@effects.effect("order-history", on=OrderPlaced)
async def record_order(event: OrderPlaced, ctx: oncely.AsyncEffectContext) -> None:
    ctx.insert(
        OrderHistory,
        {
            "event_id": ctx.event_id,
            "order_id": event.order_id,
            "customer_email": event.customer_email,
            "total": event.total,
            "currency": event.currency,
            "placed_at": event.placed_at,
        },
    )
