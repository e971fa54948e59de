"""oncely's pytest plugin: real Kafka and PostgreSQL fixtures, opt-in.

Enable it with ``-p oncely.testing`` (or ``pytest_plugins = ["oncely.testing"]`` in the root
``conftest.py``); without that, installing oncely adds no fixture to a project's tests.

Fixtures (all named ``oncely_*``, so they never shadow a project's own):

- ``oncely_services`` (session): the :class:`~oncely.testing.services.Services` in use.
- ``oncely_kafka_bootstrap`` (session): bootstrap servers string.
- ``oncely_kafka_admin`` (session): a confluent-kafka ``AdminClient``.
- ``oncely_new_topic`` (function): ``oncely_new_topic(partitions=1) -> name`` creates a
  uuid-named topic, deleted after the test.
- ``oncely_database_url`` (function): SQLAlchemy URL of a fresh database with oncely's tables,
  cloned from a session template (``oncely db upgrade`` applied once), dropped after the test.
- ``oncely_new_database`` (function): ``oncely_new_database(empty=False) -> url`` for more
  databases.
- ``oncely_pipeline`` (function): ``with oncely_pipeline(app) as pipeline:`` runs ``app``'s
  relay and consumers on threads against ``oncely_database_url`` and the broker, with
  ``pipeline.wait_until_applied(events)`` (:func:`~oncely.testing.pipeline.running_pipeline`).
  Create your own tables on ``pipeline.engine`` first, and give each test its own topics (a
  random ``Registry(topic_prefix=...)``): the broker outlives the test.
- ``oncely_schema_registry_url`` (session): the base URL of a Confluent-compatible schema
  registry (``ONCELY_TEST_SCHEMA_REGISTRY_URL``, else Apicurio Registry from Maven Central,
  started for the session only when a test asks for it). Tests share it: give each test its own
  topics (``oncely_new_topic``, a random topic prefix), hence its own subjects.

When no services can be had, every test that asks for them fails with the reason; it never
skips.

Options:

- ``--oncely-partitioned=STEP`` (e.g. ``1m``): the template, hence every database
  ``oncely_database_url`` and ``oncely_new_database()`` give, has the partitioned layout
  (``oncely db upgrade --partition-every STEP``), with partitions created ahead for
  ``--oncely-partitioned-horizon`` (default ``2h``) from the session's start, so the rows of a
  whole run land in range partitions rather than the default one. The
  ``oncely_partition_step`` fixture is the step (``None`` without the option).
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql
from sqlalchemy.engine import make_url

from oncely.durations import parse_duration
from oncely.errors import ConfigurationError
from oncely.storage import partitions
from oncely.storage.migrations import upgrade
from oncely.testing.pipeline import Pipeline, running_pipeline
from oncely.testing.services import (
    SchemaRegistry,
    Services,
    ServicesUnavailableError,
    libpq_dsn,
    provide_schema_registry,
    provide_services,
)

TEMPLATE_DATABASE = "oncely_test_template"
#: How far ahead of the session's start ``--oncely-partitioned`` creates partitions.
DEFAULT_PARTITION_HORIZON = "2h"
_services_key = pytest.StashKey[Services]()
_registry_key = pytest.StashKey[SchemaRegistry]()
_worker_services_key = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("oncely", "oncely's real-service fixtures")
    group.addoption(
        "--oncely-partitioned",
        metavar="STEP",
        default=None,
        help="test databases have the partitioned outbox and receipts of this step "
        "(oncely db upgrade --partition-every STEP), e.g. 1m",
    )
    group.addoption(
        "--oncely-partitioned-horizon",
        metavar="DURATION",
        default=DEFAULT_PARTITION_HORIZON,
        help="with --oncely-partitioned: create partitions this far ahead of the session's "
        f"start, e.g. 90m, 3h (default {DEFAULT_PARTITION_HORIZON})",
    )


def _partitioning(config: pytest.Config) -> tuple[timedelta, timedelta] | None:
    """``(step, horizon)`` of ``--oncely-partitioned``, ``None`` without it."""
    step_text = config.getoption("--oncely-partitioned")
    if step_text is None:
        return None
    horizon_text = str(config.getoption("--oncely-partitioned-horizon"))
    try:
        horizon = parse_duration(horizon_text)
    except ValueError:
        raise pytest.UsageError(
            f"--oncely-partitioned-horizon {horizon_text!r}: give minutes, hours or days, "
            "e.g. 90m or 3h"
        ) from None
    try:
        step = partitions.parse_step(str(step_text))
    except ConfigurationError as exc:
        raise pytest.UsageError(f"--oncely-partitioned: {exc}") from None
    return step, horizon


def pytest_configure(config: pytest.Config) -> None:
    _partitioning(config)  # a bad value fails the run at once, not at the first database


@pytest.fixture(scope="session")
def oncely_partition_step(pytestconfig: pytest.Config) -> timedelta | None:
    """The partition step of the test databases (``--oncely-partitioned``), else ``None``."""
    partitioning = _partitioning(pytestconfig)
    return None if partitioning is None else partitioning[0]


@pytest.fixture(scope="session")
def oncely_services(request: pytest.FixtureRequest) -> Iterator[Services]:
    """Kafka and PostgreSQL for this test session (see :mod:`oncely.testing.services`)."""
    try:
        with provide_services() as services:
            request.config.stash[_services_key] = services
            yield services
    except ServicesUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def oncely_kafka_bootstrap(oncely_services: Services) -> str:
    return oncely_services.kafka_bootstrap


@pytest.fixture(scope="session")
def oncely_kafka_admin(oncely_kafka_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": oncely_kafka_bootstrap})


@pytest.fixture
def oncely_new_topic(oncely_kafka_admin: AdminClient) -> Iterator[Callable[..., str]]:
    """Create uuid-named topics: ``oncely_new_topic(partitions=1, config=None) -> name``."""
    created: list[str] = []

    def create(partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"test-{uuid.uuid4().hex}"
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})
        oncely_kafka_admin.create_topics([topic])[name].result(30)
        created.append(name)
        return name

    yield create
    if created:
        for future in oncely_kafka_admin.delete_topics(created).values():
            future.result(30)


@pytest.fixture(scope="session")
def oncely_schema_registry_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A Confluent-compatible schema registry's URL (see :mod:`oncely.testing.services`)."""
    try:
        with provide_schema_registry(tmp_path_factory.mktemp("schema-registry")) as registry:
            request.config.stash[_registry_key] = registry
            yield registry.url
    except ServicesUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def _oncely_template(oncely_services: Services, pytestconfig: pytest.Config) -> str:
    """Create the template database (with oncely's tables) that test databases are cloned from:
    partitioned, with partitions ahead for the horizon, under ``--oncely-partitioned``."""
    with psycopg.connect(libpq_dsn(oncely_services.database_url), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(TEMPLATE_DATABASE)
            )
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE_DATABASE)))
    url = make_url(oncely_services.database_url).set(database=TEMPLATE_DATABASE)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    partitioning = _partitioning(pytestconfig)
    upgrade(engine, partition_every=None if partitioning is None else partitioning[0])
    if partitioning is not None:
        step, horizon = partitioning
        now = datetime.now(UTC)
        with engine.begin() as conn:
            for table in partitions.PARTITION_KEYS:
                partitions.create_ahead(conn, table, step, until=now + horizon, now=now)
    engine.dispose()
    return TEMPLATE_DATABASE


@pytest.fixture
def oncely_new_database(
    oncely_services: Services, _oncely_template: str
) -> Iterator[Callable[..., str]]:
    """Create fresh databases: ``oncely_new_database(empty=False) -> SQLAlchemy URL``.

    A database is cloned from the template that has oncely's tables, or is empty with
    ``empty=True``. All are dropped after the test.
    """
    maintenance = libpq_dsn(oncely_services.database_url)
    created: list[str] = []

    def create(*, empty: bool = False) -> str:
        name = f"test_{uuid.uuid4().hex}"
        template = "template0" if empty else _oncely_template
        with psycopg.connect(maintenance, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)
                )
            )
        created.append(name)
        return (
            make_url(oncely_services.database_url)
            .set(database=name)
            .render_as_string(hide_password=False)
        )

    yield create
    with psycopg.connect(maintenance, autocommit=True) as conn:
        for name in created:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def oncely_database_url(oncely_new_database: Callable[..., str]) -> str:
    """A fresh database with oncely's tables, for this test only (dropped afterwards)."""
    return oncely_new_database()


@pytest.fixture
def oncely_pipeline(
    oncely_database_url: str, oncely_kafka_bootstrap: str
) -> Callable[..., contextlib.AbstractContextManager[Pipeline]]:
    """``oncely_pipeline(app, effects=None, relay=None, consumer=None)``: the context manager
    of :func:`~oncely.testing.pipeline.running_pipeline` on this test's database and broker."""
    return functools.partial(
        running_pipeline, database_url=oncely_database_url, bootstrap_servers=oncely_kafka_bootstrap
    )


def _described(config: pytest.Config) -> list[str]:
    """This process's services, one line each."""
    return [
        found.describe()
        for found in (config.stash.get(_services_key, None), config.stash.get(_registry_key, None))
        if found is not None
    ]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist, a worker hands its services' lines to the controller's summary."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["oncely_services"] = _described(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's hook, in the controller: keep a worker's services' lines."""
    lines = getattr(node, "workeroutput", {}).get("oncely_services", [])
    node.config.stash.setdefault(_worker_services_key, []).extend(lines)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    lines = _described(config) + config.stash.get(_worker_services_key, [])
    if not lines:
        return
    terminalreporter.write_sep("-", "oncely test services")
    for line in lines:
        terminalreporter.write_line(line)
    partitioning = _partitioning(config)
    if partitioning is not None:
        step, horizon = partitioning
        terminalreporter.write_line(
            f"test databases partitioned: outbox and receipts by {step}, partitions "
            f"created {horizon} ahead of the session's start"
        )
