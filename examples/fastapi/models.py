"""The orders service's tables: its orders, and the order history the ``order-history`` effect
keeps (a read model, in the same database here).

``order_history`` has no unique constraint on the order on purpose: if a receipt ever failed to
keep the effect single, the duplicate would show (the example's test looks for one).
``orders.idempotency_key`` is unique: whatever happens to the idempotency claim, one key can
never create two orders.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """The service's tables (create them with your migrations; the example uses create_all)."""


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer_email: Mapped[str]
    total: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))
    currency: Mapped[str] = mapped_column(sa.String(3))
    placed_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), server_default=sa.func.now()
    )
    idempotency_key: Mapped[str] = mapped_column(unique=True)


class OrderHistory(Base):
    __tablename__ = "order_history"

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    event_id: Mapped[uuid.UUID]
    order_id: Mapped[uuid.UUID]
    customer_email: Mapped[str] = mapped_column(index=True)
    total: Mapped[Decimal] = mapped_column(sa.Numeric(12, 2))
    currency: Mapped[str] = mapped_column(sa.String(3))
    placed_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
