"""Two event types of one aggregate, ``order.paid`` and ``order.refunded``, for the tests of
topic provisioning: :func:`build` registers both on topics of their own."""

from __future__ import annotations

from pydantic import BaseModel

from oncely.events import Registry


class Paid(BaseModel):
    order: str


class Refunded(BaseModel):
    order: str


def build(topic_prefix: str) -> tuple[Registry, str, str]:
    """A registry of both types on ``<topic_prefix>order.paid`` and
    ``<topic_prefix>order.refunded``, and those two topics."""
    registry = Registry(topic_prefix=topic_prefix)
    registry.register(Paid, name="order.paid", key="order", aggregate="order")
    registry.register(Refunded, name="order.refunded", key="order", aggregate="order")
    return registry, registry.for_model(Paid).topic, registry.for_model(Refunded).topic
