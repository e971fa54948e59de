"""A hot key and 100,000 rows committed in one transaction drain, each once in per-key order
(``make chaos``). ``make test`` keeps the same test with 30,000 rows, enough for the relay's
pages to reach their cap and its in-flight bound to hold it back several times
(tests/integration/test_relay.py::test_a_hot_key_and_a_huge_transaction_drain)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from tests.integration.test_relay import drain_a_hot_key_and_a_huge_transaction

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def test_a_hot_key_and_a_transaction_of_100_000_rows_drain(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    drain_a_hot_key_and_a_huge_transaction(engine, kafka_bootstrap, topic, 100_000)
