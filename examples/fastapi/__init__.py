"""A FastAPI orders service on oncely: idempotent ``POST /orders`` that stages ``order.placed``.

- ``api.py``: the FastAPI app (``uvicorn examples.fastapi.api:api``): an ``AsyncSession`` per
  request, the order row and its event in one transaction, ``Idempotency-Key`` handled by
  ``oncely.AsyncIdempotencyKeys``.
- ``events.py``, ``effects.py``, ``app.py``: the event type, an ``async def`` effect that keeps
  a customer's order history, and the ``oncely.App`` the commands name
  (``oncely consume --app examples.fastapi.app:app --effect order-history``).
- ``models.py``: the service's tables.

``docs/how-to/fastapi.md`` walks through it; ``tests/integration/test_fastapi_example.py``
drives it with httpx against real PostgreSQL and Kafka.
"""
