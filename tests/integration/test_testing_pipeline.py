"""What users get from ``oncely.testing`` to test their own pipeline: ``oncely_pipeline`` runs
an app's relay and consumers against the real broker and database, and waits until applied."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely import App, stage
from oncely.testing import Pipeline
from tests.apps import ledger
from tests.helpers import scalar

pytestmark = pytest.mark.integration


def test_a_staged_event_is_applied_once_by_each_effect(
    oncely_pipeline: Callable[..., AbstractContextManager[Pipeline]],
) -> None:
    built = ledger.build(f"t{uuid.uuid4().hex[:8]}.", f"g{uuid.uuid4().hex[:8]}.")
    app = App(effects=built.effects)
    with oncely_pipeline(app, effects=["ledger", "audit"]) as pipeline:
        ledger.create_tables(pipeline.engine)
        with Session(pipeline.engine) as session, session.begin():
            session.execute(sa.text("INSERT INTO accounts VALUES ('a-1')"))
            staged = [
                stage(session, built.model(account_id="a-1", amount=5, n=n)) for n in range(3)
            ]
        pipeline.wait_until_applied(staged)
        rows = scalar(pipeline.engine, "SELECT count(*) FROM ledger WHERE effect = 'ledger'")
        assert rows == 3
        with pytest.raises(TimeoutError, match=r"1 of 1 \(event, effect\) pairs not applied"):
            pipeline.wait_until_applied([uuid.uuid4()], effects=["ledger"], timeout=0.2)
