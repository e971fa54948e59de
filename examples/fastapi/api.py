"""The orders API: ``POST /orders`` places an order once per ``Idempotency-Key`` and stages
``order.placed`` in the same transaction; ``GET /orders/{order_id}`` reads it back.

Run it with ``uvicorn examples.fastapi.api:api``; ``ONCELY_DATABASE_URL`` names the database,
which holds oncely's tables (``oncely db upgrade``) and the service's (``models.py``).

Each ``POST /orders`` claims its key with :class:`oncely.AsyncIdempotencyKeys` (a short
transaction of its own, visible to concurrent requests at once), writes the order and stages
its event in one transaction, then records the response under the key. The answers follow the
IETF draft on the ``Idempotency-Key`` header:

==============================================  ==============================================
request                                         response
==============================================  ==============================================
a new key                                       201 and the order: its row and its event
                                                committed together
the same key and body, the first one answered   201 and the first response again, with
                                                ``Idempotent-Replayed: true``; nothing staged
the same key while the first one is running     409 with ``Retry-After``: retry later
the same key with another body                  422: a key names one request, never two
no key, an empty one or one over 200 chars      400
a body that does not validate                   422 from FastAPI; the key is not claimed
the transaction fails                           500; the key is released, retry with it
==============================================  ==============================================

Errors of the key are problem details (RFC 9457, ``application/problem+json``). A request cut
off between its commit and recording its response leaves the key "processing": a retry gets
409 until the claim is stale (10 minutes), then finds the order placed under the key and
answers with it. The unique ``orders.idempotency_key`` is the last line: one key never makes
two orders.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from typing import Annotated, TypedDict
from uuid import UUID, uuid4

import sqlalchemy as sa
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import oncely
from examples.fastapi.events import Currency, Money, OrderPlaced
from examples.fastapi.models import Order

OWNER = "orders-api"
"""Who picks the idempotency keys. Behind authentication, use the caller's user id."""


class Settings(BaseSettings):
    """The service's settings, from the environment (the database oncely's commands use)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_")

    database_url: str


class State(TypedDict):
    """What the lifespan opens for the requests (``request.state``)."""

    sessions: async_sessionmaker[AsyncSession]
    idempotency_keys: oncely.AsyncIdempotencyKeys


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[State]:
    """One engine for the process (psycopg 3, async), disposed at shutdown."""
    url = sa.make_url(Settings().database_url).set(drivername="postgresql+psycopg")
    engine = create_async_engine(url, pool_pre_ping=True)
    try:
        yield {
            "sessions": async_sessionmaker(engine, expire_on_commit=False),
            "idempotency_keys": oncely.AsyncIdempotencyKeys(engine),
        }
    finally:
        await engine.dispose()


api = FastAPI(title="Orders", lifespan=lifespan)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session per request; the endpoint opens its transaction (``session.begin()``)."""
    sessions: async_sessionmaker[AsyncSession] = request.state.sessions
    async with sessions() as session:
        yield session


def get_idempotency_keys(request: Request) -> oncely.AsyncIdempotencyKeys:
    keys: oncely.AsyncIdempotencyKeys = request.state.idempotency_keys
    return keys


def get_idempotency_key(
    idempotency_key: Annotated[
        str | None, Header(description="A new unique value (a UUID) per order, kept on retries.")
    ] = None,
) -> str:
    """The ``Idempotency-Key`` header; a missing one is refused with 400, as an empty one."""
    if idempotency_key is None:
        raise oncely.InvalidIdempotencyKeyError(
            "the Idempotency-Key header is missing: send a new unique value (a UUID) per "
            "order, and the same value when you retry it"
        )
    return idempotency_key


SessionDep = Annotated[AsyncSession, Depends(get_session)]
KeysDep = Annotated[oncely.AsyncIdempotencyKeys, Depends(get_idempotency_keys)]
IdempotencyKeyDep = Annotated[str, Depends(get_idempotency_key)]


class PlaceOrder(BaseModel):
    """The body of ``POST /orders``."""

    model_config = ConfigDict(extra="forbid")

    customer_email: Annotated[str, Field(pattern=r"^[^@\s]+@[^@\s]+$", max_length=254)]
    total: Money
    currency: Currency = "EUR"

    def fingerprint(self) -> str:
        """What makes two requests the same request: the endpoint and the parsed body."""
        return hashlib.sha256(f"POST /orders {self.model_dump_json()}".encode()).hexdigest()


class OrderOut(BaseModel):
    """An order as the API returns it (from its row)."""

    model_config = ConfigDict(from_attributes=True)

    id: UUID
    customer_email: str
    total: Decimal
    currency: str
    placed_at: datetime


@api.post(
    "/orders",
    status_code=201,
    responses={
        400: {"description": "Idempotency-Key missing or invalid"},
        409: {"description": "A request with this Idempotency-Key is being processed"},
        422: {"description": "Invalid body, or the Idempotency-Key was used for another body"},
    },
)
async def place_order(
    order: PlaceOrder,
    key: IdempotencyKeyDep,
    session: SessionDep,
    keys: KeysDep,
    response: Response,
) -> OrderOut:
    claim = await keys.claim(OWNER, key, fingerprint=order.fingerprint())
    if claim.previous is not None:
        response.headers["Idempotent-Replayed"] = "true"
        return _created(response, OrderOut.model_validate(claim.previous["result"]))
    try:
        async with session.begin():
            # Placed already when an earlier attempt committed but could not record its
            # response (it crashed, its claim went stale and this one took it over).
            row = await session.scalar(sa.select(Order).where(Order.idempotency_key == key))
            if row is None:
                row = await _insert(session, order, key)
                oncely.stage(
                    session,
                    OrderPlaced(
                        order_id=row.id,
                        customer_email=row.customer_email,
                        total=row.total,
                        currency=row.currency,
                        placed_at=row.placed_at,
                    ),
                )
    except Exception as error:
        await keys.finish(OWNER, key, "rejected", detail=type(error).__name__)
        raise
    placed = OrderOut.model_validate(row)
    await keys.finish(OWNER, key, "accepted", result=placed.model_dump(mode="json"))
    return _created(response, placed)


async def _insert(session: AsyncSession, order: PlaceOrder, key: str) -> Order:
    """INSERT ... RETURNING: the row as the database stores it (its rounding, its clock)."""
    values = {**order.model_dump(), "id": uuid4(), "idempotency_key": key}
    row: Order = (await session.scalars(sa.insert(Order).values(values).returning(Order))).one()
    return row


def _created(response: Response, order: OrderOut) -> OrderOut:
    response.headers["Location"] = f"/orders/{order.id}"
    return order


@api.get("/orders/{order_id}", responses={404: {"description": "No such order"}})
async def get_order(order_id: UUID, session: SessionDep) -> OrderOut:
    row = await session.get(Order, order_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no order {order_id}")
    return OrderOut.model_validate(row)


def _problem(
    status: int, title: str, error: Exception, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """A problem details response (RFC 9457)."""
    return JSONResponse(
        {"title": title, "status": status, "detail": str(error)},
        status_code=status,
        headers=headers,
        media_type="application/problem+json",
    )


@api.exception_handler(oncely.InvalidIdempotencyKeyError)
async def invalid_key(request: Request, error: oncely.InvalidIdempotencyKeyError) -> JSONResponse:
    return _problem(400, "Idempotency-Key is missing or invalid", error)


@api.exception_handler(oncely.IdempotencyBusyError)
async def key_in_use(request: Request, error: oncely.IdempotencyBusyError) -> JSONResponse:
    title = "A request with this Idempotency-Key is being processed"
    return _problem(409, title, error, {"Retry-After": "1"})


@api.exception_handler(oncely.IdempotencyMismatchError)
async def key_reused(request: Request, error: oncely.IdempotencyMismatchError) -> JSONResponse:
    return _problem(422, "Idempotency-Key is already used for another request", error)
