"""Fixtures of the fault-injection scenarios: a fresh app on its own topics, and a pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import NewTopic

from tests.apps.ledger import App, build, create_tables
from tests.chaos.harness import RETENTION_REPORTS, Pipeline, pipeline, unique_prefix


@pytest.fixture
def app(kafka_admin: Any) -> App:
    prefix = unique_prefix()
    app = build(prefix, group_prefix=prefix, ways=True)
    kafka_admin.create_topics([NewTopic(app.topic, num_partitions=3)])[app.topic].result(30)
    return app


@pytest.fixture
def chaos(database_url: str, kafka_bootstrap: str, app: App, tmp_path: Path) -> Iterator[Pipeline]:
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    try:
        with pipeline(engine, database_url, kafka_bootstrap, app, tmp_path) as running:
            yield running
    finally:  # also when the pipeline's end check fails: no connection left to the next test
        engine.dispose()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What retention did in each scenario (it runs through every pipeline of the harness)."""
    if RETENTION_REPORTS:
        terminalreporter.section("retention during the scenarios")
        for line in RETENTION_REPORTS:
            terminalreporter.write_line(line)
