"""Fixtures shared by the suites. The real-service ones come from the ``oncely.testing`` plugin
(enabled in pyproject.toml's addopts, as a project using oncely enables it); the suites use them
under their short names."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from tests.apps import ledger


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Undo a test's logging set-up: a long-running command run in-process configures the root
    logger on the test's captured stderr, closed once the test ends."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def kafka_bootstrap(oncely_kafka_bootstrap: str) -> str:
    return oncely_kafka_bootstrap


@pytest.fixture(scope="session")
def kafka_admin(oncely_kafka_admin: AdminClient) -> AdminClient:
    return oncely_kafka_admin


@pytest.fixture(scope="session")
def schema_registry_url(oncely_schema_registry_url: str) -> str:
    return oncely_schema_registry_url


@pytest.fixture
def new_topic(oncely_new_topic: Callable[..., str]) -> Callable[..., str]:
    return oncely_new_topic


@pytest.fixture
def new_database(oncely_new_database: Callable[..., str]) -> Callable[..., str]:
    return oncely_new_database


@pytest.fixture
def database_url(oncely_database_url: str) -> str:
    return oncely_database_url


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    """An engine on the test's fresh database (oncely's tables in it), disposed after."""
    engine = sa.create_engine(database_url, pool_size=5)
    yield engine
    engine.dispose()


@pytest.fixture
def ledger_tables(engine: sa.Engine) -> None:
    """The ledger app's tables in the test's database (``usefixtures("ledger_tables")``)."""
    ledger.create_tables(engine)


@pytest.fixture
def new_ledger(kafka_admin: AdminClient) -> Iterator[Callable[..., ledger.App]]:
    """``new_ledger(partitions=1, ways=False, config=None, prefix="t") -> App``: the ledger app
    on its own prefix (topics and groups), its topic created; deleted after the test."""
    topics: list[str] = []

    def create(
        partitions: int = 1,
        *,
        ways: bool = False,
        config: dict[str, str] | None = None,
        prefix: str = "t",
    ) -> ledger.App:
        unique = f"{prefix}{uuid.uuid4().hex[:10]}."
        app = ledger.build(unique, group_prefix=unique, ways=ways)
        topic = NewTopic(app.topic, num_partitions=partitions, config=config or {})
        kafka_admin.create_topics([topic])[app.topic].result(30)
        topics.append(app.topic)
        return app

    yield create
    if topics:
        for future in kafka_admin.delete_topics(topics).values():
            future.result(30)
