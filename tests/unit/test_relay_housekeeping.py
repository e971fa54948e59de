"""The relay's purge timer never stops the relay: a failed retention run is logged and counted,
and the next interval tries again."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from oncely.relay.housekeeping import Housekeeping
from oncely.runtime.metrics import RetentionMetrics
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage.stores.outbox.relay import RelayStore


def test_a_failed_retention_run_is_counted_and_does_not_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    housekeeping = Housekeeping(
        store=RelayStore(engine, owner="test"),
        settings=RelaySettings(),
        retention_settings=RetentionSettings(),
        kafka={},
        metrics=RetentionMetrics(registry),
    )
    housekeeping._step = timedelta(days=1)  # found partitioned: not asked again
    with caplog.at_level(logging.WARNING, logger="oncely.relay.housekeeping"):
        for _ in range(2):
            housekeeping.due()
            housekeeping.join(30)
    assert housekeeping.runs == 2
    assert registry.get_sample_value("oncely_retention_errors_total") == 2
    assert "purge failed, retried at the next interval" in caplog.text
    engine.dispose()
