"""oncely.testing's helpers for users' tests, on real PostgreSQL: an event applied twice to an
effect in the test's transaction is applied once, a failing handler leaves nothing behind, and a
transaction's staged events are listed (its own only)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from oncely import stage
from oncely.errors import ConfigurationError
from oncely.testing import apply_event, apply_event_async, staged_events
from tests.apps.ledger import App, build, ledger

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]


@pytest.fixture
def app() -> App:
    """Not the shared ``app``: no topic at all, the helpers under test apply events in this
    process."""
    return build("helpers.", ways=True)


def _ledger_rows(session: Session) -> list[tuple[uuid.UUID, str, int]]:
    rows = session.execute(sa.select(ledger.c.event_id, ledger.c.effect, ledger.c.amount))
    return [tuple(row) for row in rows]  # type: ignore[misc]


@pytest.mark.parametrize("effect", ["ledger", "audit", "ledger.insert", "ledger.batch"])
def test_an_event_applied_twice_is_applied_once(app: App, engine: sa.Engine, effect: str) -> None:
    event_id = uuid.uuid4()
    event = app.model(account_id="a-1", amount=7, n=1)
    with Session(engine) as session, session.begin():
        assert apply_event(app.effects, effect, event, session, event_id=event_id)
        assert not apply_event(app.effects, effect, event, session, event_id=event_id)
        assert apply_event(app.effects, effect, event, session)  # another event id
        rows = _ledger_rows(session)
        assert rows.count((event_id, effect, 7)) == 1
        assert len(rows) == 2
        session.rollback()
    with Session(engine) as session:
        assert _ledger_rows(session) == [], "the test's rollback leaves nothing"


def test_a_failing_handler_raises_and_leaves_no_receipt(app: App, engine: sa.Engine) -> None:
    event_id = uuid.uuid4()
    with Session(engine) as session, session.begin():
        with pytest.raises(ValueError, match="negative amount -1"):
            apply_event(
                app.effects, "ledger", app.model(account_id="a", amount=-1, n=1), session,
                event_id=event_id,
            )  # fmt: skip
        fixed = app.model(account_id="a", amount=1, n=1)
        assert apply_event(app.effects, "ledger", fixed, session, event_id=event_id)
        assert _ledger_rows(session) == [(event_id, "ledger", 1)]


def test_async_effects_and_foreign_events_are_refused(app: App, engine: sa.Engine) -> None:
    event = app.model(account_id="a", amount=1, n=1)
    with Session(engine) as session, session.begin():
        with pytest.raises(ConfigurationError, match=r"'ledger\.async' is async: apply it with"):
            apply_event(app.effects, "ledger.async", event, session)
        other = build("helpers-other.")
        with pytest.raises(ConfigurationError, match="no durable topic registered"):
            apply_event(other.effects, "ledger", event, session)


def test_staged_events_lists_this_transaction_s_events_only(app: App, engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        stage(session, app.model(account_id="earlier", amount=1, n=1))
    with Session(engine) as session, session.begin():
        assert staged_events(session) == []
        first = stage(session, app.model(account_id="b", amount=2, n=1), idempotency_key="k-1")
        second = stage(session, app.model(account_id="c", amount=3, n=2))
        assert staged_events(session) == [first, second]


def test_an_async_effect_is_applied_once_on_an_async_session(app: App, database_url: str) -> None:
    async def run() -> list[tuple[uuid.UUID, str, int]]:
        engine = create_async_engine(database_url)
        event_id = uuid.uuid4()
        event = app.model(account_id="a-1", amount=3, n=1)
        try:
            async with AsyncSession(engine) as session, session.begin():
                effects = app.effects
                assert await apply_event_async(
                    effects, "ledger.async", event, session, event_id=event_id
                )
                assert not await apply_event_async(
                    effects, "ledger.async", event, session, event_id=event_id
                )
                with pytest.raises(ConfigurationError, match="'ledger' is not async"):
                    await apply_event_async(effects, "ledger", event, session)
                rows = await session.execute(sa.select(ledger.c.event_id, ledger.c.effect))
                return [tuple(row) for row in rows]  # type: ignore[misc]
        finally:
            await engine.dispose()

    assert len(asyncio.run(run())) == 1
