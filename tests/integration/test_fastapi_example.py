"""``examples/fastapi`` driven over HTTP against real PostgreSQL and Kafka.

The app runs as a server runs it: ``asgi_lifespan.LifespanManager`` sends the ASGI lifespan
events (so the engine opens and closes as under uvicorn, and the lifespan state reaches the
requests), and ``httpx.AsyncClient`` talks to it through ``httpx.ASGITransport``, in this
test's event loop, so two requests can overlap. FastAPI's documentation tests async apps this
way; its sync ``TestClient`` would run the app in a thread of its own, where two overlapping
requests are harder to arrange.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from asgi_lifespan import LifespanManager
from examples.fastapi.api import api
from examples.fastapi.app import app
from examples.fastapi.models import Base

from tests.helpers import (
    fast_settings,
    oncely_cli,
    query_one,
    running_consumers,
    running_relay,
    scalar,
)
from tests.helpers import wait_until as wait_until_sync

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

ORDER = {"customer_email": "ada@example.test", "total": "42.5", "currency": "EUR"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def shop(engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch) -> sa.Engine:
    """The test's database with the service's tables; the app reads it from the environment."""
    Base.metadata.create_all(engine)
    monkeypatch.setenv("ONCELY_DATABASE_URL", database_url)
    return engine


@pytest.fixture
async def client(shop: sa.Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        LifespanManager(api) as manager,
        httpx.AsyncClient(
            # A 500 comes back as a response, as a client sees it, not as the app's exception.
            transport=httpx.ASGITransport(app=manager.app, raise_app_exceptions=False),
            base_url="http://orders.test",
        ) as client,
    ):
        yield client


async def place(
    client: httpx.AsyncClient, key: str | None, body: dict[str, Any] = ORDER
) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return await client.post("/orders", json=body, headers=headers)


def counts(engine: sa.Engine) -> tuple[object, object]:
    """(orders, outbox rows) in the database."""
    return scalar(engine, "SELECT count(*) FROM orders"), scalar(
        engine, "SELECT count(*) FROM oncely_outbox"
    )


def claim_status(engine: sa.Engine, key: str) -> str | None:
    """The status of the key's claim (``None``: never claimed)."""
    with engine.connect() as conn:
        status: str | None = conn.execute(
            sa.text("SELECT status FROM oncely_idempotency_keys WHERE key = :k"), {"k": key}
        ).scalar()
    return status


async def wait_until(predicate: Callable[[], bool], *, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"not met within {timeout} s"
        await asyncio.sleep(0.05)


async def test_an_order_and_its_event_commit_in_the_request_s_transaction(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    response = await place(client, "key-1")
    assert response.status_code == 201, response.text
    order = response.json()
    assert order["customer_email"] == "ada@example.test"
    assert order["total"] == "42.50", "the row as stored (INSERT ... RETURNING)"
    assert response.headers["Location"] == f"/orders/{order['id']}"
    assert "Idempotent-Replayed" not in response.headers
    read = await client.get(f"/orders/{order['id']}")
    assert read.status_code == 200
    assert read.json() == order

    assert counts(shop) == (1, 1)
    event = query_one(
        shop,
        "SELECT o.type, o.topic, o.aggregateid, o.txid::text::bigint AS txid, "
        "orders.xmin::text::bigint AS order_xid FROM oncely_outbox AS o, orders",
    )
    assert (event.type, event.topic) == ("order.placed", "storefront.order.placed")
    assert event.aggregateid == order["id"]
    # One transaction wrote both rows: the outbox row's xid8 wraps to the order row's xmin.
    assert event.txid % 2**32 == event.order_xid
    assert claim_status(shop, "key-1") == "accepted"


async def test_a_retry_with_the_same_key_gets_the_first_response_and_stages_nothing(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    first = await place(client, "key-1")
    again = await place(client, "key-1")
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert counts(shop) == (1, 1)

    other = await place(client, "key-2")  # the key names the request, not the body
    assert other.status_code == 201
    assert other.json()["id"] != first.json()["id"]
    assert counts(shop) == (2, 2)


async def test_the_same_key_with_another_body_is_422_and_changes_nothing(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    assert (await place(client, "key-1")).status_code == 201
    response = await place(client, "key-1", {**ORDER, "total": "43.00"})
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["title"] == "Idempotency-Key is already used for another request"
    assert problem["status"] == 422
    assert counts(shop) == (1, 1)


async def test_the_same_key_while_the_first_request_runs_is_409(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    def first_waits_on_the_lock() -> bool:
        waiting = scalar(
            shop,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO orders %'",
        )
        return claim_status(shop, "key-1") == "processing" and waiting == 1

    # The test holds a lock that the first request's INSERT waits for: it is claimed and
    # running, deterministically, while the second one arrives.
    with shop.connect() as lock, lock.begin():
        lock.execute(sa.text("LOCK TABLE orders IN SHARE MODE"))
        first = asyncio.create_task(place(client, "key-1"))
        await wait_until(first_waits_on_the_lock, timeout=30)
        second = await place(client, "key-1")
        assert second.status_code == 409, second.text
        assert second.headers["Retry-After"] == "1"
        assert second.headers["content-type"] == "application/problem+json"
        assert second.json()["title"] == "A request with this Idempotency-Key is being processed"
        assert not first.done()
    response = await first
    assert response.status_code == 201, response.text
    assert counts(shop) == (1, 1)
    replay = await place(client, "key-1")
    assert (replay.status_code, replay.content) == (201, response.content)


async def test_a_request_cut_off_after_its_commit_is_answered_from_its_order(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    placed = await place(client, "key-1")
    assert placed.status_code == 201

    def cut_off(age: str) -> None:
        """Leave the claim as a process that died between its commit and its response."""
        with shop.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE oncely_idempotency_keys SET status = 'processing', result = NULL, "
                    "finished_at = NULL, received_at = now() - CAST(:age AS interval)"
                ),
                {"age": age},
            )

    cut_off("1 second")
    assert (await place(client, "key-1")).status_code == 409, "it may still be running"
    cut_off("11 minutes")  # past the claim's stale limit: the retry takes it over
    retried = await place(client, "key-1")
    assert retried.status_code == 201, retried.text
    assert retried.json() == placed.json(), "the order placed under the key, not a new one"
    assert counts(shop) == (1, 1)
    assert claim_status(shop, "key-1") == "accepted"


async def test_bad_requests_are_refused_before_the_key_is_used(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    missing = await place(client, None)
    assert missing.status_code == 400
    assert "Idempotency-Key header is missing" in missing.json()["detail"]
    too_long = await place(client, "k" * 201)
    assert too_long.status_code == 400
    assert too_long.headers["content-type"] == "application/problem+json"

    invalid = await place(client, "key-1", {**ORDER, "total": "-1"})
    assert invalid.status_code == 422
    assert invalid.json()["detail"][0]["loc"] == ["body", "total"], "FastAPI's validation"
    assert claim_status(shop, "key-1") is None, "an invalid body does not claim its key"
    assert (await place(client, "key-1")).status_code == 201
    assert (await client.get("/orders/00000000-0000-0000-0000-000000000000")).status_code == 404


async def test_a_failed_transaction_leaves_no_order_no_event_and_releases_the_key(
    client: httpx.AsyncClient, shop: sa.Engine
) -> None:
    # A deferred constraint trigger refuses the order at COMMIT, after the order row and the
    # outbox row were both written: the transaction rolls back as a whole.
    with shop.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
            )
        )
        conn.execute(
            sa.text(
                "CREATE CONSTRAINT TRIGGER refuse_orders AFTER INSERT ON orders "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    failed = await place(client, "key-1")
    assert failed.status_code == 500
    assert counts(shop) == (0, 0)
    assert claim_status(shop, "key-1") == "rejected"

    with shop.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER refuse_orders ON orders"))
    retried = await place(client, "key-1")
    assert retried.status_code == 201, retried.text
    assert counts(shop) == (1, 1)


async def test_the_relay_publishes_the_order_and_the_async_effect_applies_it_once(
    client: httpx.AsyncClient, shop: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    ensured = oncely_cli(
        "topics", "ensure", "--app", "examples.fastapi.app:app",
        "--bootstrap-servers", kafka_bootstrap,
    )  # fmt: skip
    assert ensured.exit_code == 0, ensured.output
    since = datetime.now(UTC) - timedelta(seconds=5)
    order = (await place(client, "key-1")).json()
    event_id = scalar(shop, "SELECT id FROM oncely_outbox")

    def history() -> object:
        return scalar(shop, "SELECT count(*) FROM order_history WHERE order_id = :o", o=order["id"])

    def receipts() -> object:
        return scalar(
            shop,
            "SELECT count(*) FROM oncely_receipts WHERE event_id = :e AND effect = 'order-history'",
            e=event_id,
        )

    assert app.effects is not None
    with (
        running_relay(shop, kafka_bootstrap, fast_settings()),
        running_consumers(app.effects, ["order-history"], shop, kafka_bootstrap) as [consumer],
    ):
        wait_until_sync(lambda: history() == 1, timeout=90)
        assert receipts() == 1
        with shop.connect() as conn:
            applied = conn.execute(
                sa.text(
                    "SELECT event_id, customer_email, total FROM order_history WHERE order_id = :o"
                ),
                {"o": order["id"]},
            ).one()
        assert applied.event_id == event_id
        assert (applied.customer_email, str(applied.total)) == ("ada@example.test", "42.50")

        # Recovery republishes the order's event with its id: the receipt absorbs it.
        replayed = oncely_cli(
            "replay", "--from-outbox", "--since", since.isoformat(), "--execute",
            "--database-url", database_url, "--bootstrap-servers", kafka_bootstrap,
        )  # fmt: skip
        assert replayed.exit_code == 0, replayed.output
        registry = consumer.metrics.registry  # type: ignore[attr-defined]

        def duplicates() -> float:
            sample = registry.get_sample_value(
                "oncely_consumer_duplicates_suppressed_total", {"effect": "order-history"}
            )
            return sample or 0.0

        # Either the receipt suppresses the copy or the effect applies a second time.
        wait_until_sync(lambda: duplicates() >= 1 or history() != 1, timeout=60)
        assert (history(), receipts(), duplicates()) == (1, 1, 1)
