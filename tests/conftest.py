"""Fixtures shared by the suites, and the suite's own environment.

The real-service fixtures come from the ``oncely.testing`` plugin (enabled in pyproject.toml's
addopts, as a project using oncely enables it); the suites use them under their short names.

The suite is hermetic: before any test runs, every ``ONCELY_*`` variable of the developer's
shell is removed (but those in :data:`INHERITED`), and the devstack folder and the caches point
at folders the suite owns, so a stack that ``oncely dev up`` runs in its default folder, or a
developer's own settings, change no test. Subprocesses inherit this environment.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

import oncely.failpoints
from oncely.wire import progress_topic
from tests.apps import ledger

#: The ``ONCELY_*`` variables taken from the developer's shell: the services the
#: ``oncely.testing`` plugin documents, the container tests' images, and the long fuzz tests'
#: example count.
INHERITED = frozenset(
    {
        "ONCELY_TEST_KAFKA",
        "ONCELY_TEST_DATABASE_URL",
        "ONCELY_TEST_SCHEMA_REGISTRY_URL",
        "ONCELY_TEST_SERVICES",
        "ONCELY_TEST_IMAGE",
        "ONCELY_TEST_KAFKA_IMAGE",
        "ONCELY_TEST_POSTGRES_IMAGE",
        "ONCELY_FUZZ_EXAMPLES",
    }
)
#: oncely's cache for the tests (Kafka's classpath, which Maven takes a minute to resolve): kept
#: between runs, in the work tree (git ignores ``.oncely/``), never ``~/.cache/oncely``.
TEST_CACHE = Path(__file__).resolve().parent.parent / ".oncely" / "test-cache"


def hermetic_environment(environ: MutableMapping[str, str], scratch: Path) -> None:
    """Make ``environ`` the suite's: no ``ONCELY_*`` variable but :data:`INHERITED`, the
    devstack folder and the XDG cache under ``scratch``, oncely's cache :data:`TEST_CACHE`."""
    for name in [n for n in environ if n.startswith("ONCELY_") and n not in INHERITED]:
        del environ[name]
    environ["ONCELY_CACHE_DIR"] = str(TEST_CACHE)
    # The devstack, not testcontainers, unless the shell chose: a Docker or podman socket that
    # happens to answer changes no test (`make test-container` runs the testcontainers path).
    environ.setdefault("ONCELY_TEST_SERVICES", "devstack")
    environ["ONCELY_DEVSTACK_DIR"] = str(scratch / "devstack")
    environ["XDG_CACHE_HOME"] = str(scratch / "xdg-cache")


SCRATCH = Path(tempfile.mkdtemp(prefix="oncely-tests-"))
hermetic_environment(os.environ, SCRATCH)
# The plugin imported oncely before this file ran: failpoints read ONCELY_FAILPOINTS then.
importlib.reload(oncely.failpoints)


#: The tier marker of each test folder; the tiers that start processes or wait are also slow.
TIERS = {
    "unit": "unit",
    "integration": "integration",
    "acceptance": "acceptance",
    "chaos": "faults",
}
SLOW_TIERS = {"acceptance", "faults"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier (``-m unit``, ``-m "not slow"``)."""
    root = Path(__file__).resolve().parent
    for item in items:
        parts = item.path.resolve().relative_to(root).parts
        tier = TIERS.get(parts[0]) if len(parts) > 1 else None
        if tier is not None:
            item.add_marker(tier)
            if tier in SLOW_TIERS:
                item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.helpers.kafka import close_producers  # not at import: before the environment

    close_producers()
    shutil.rmtree(SCRATCH, ignore_errors=True)


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


@pytest.fixture
def app(new_ledger: Callable[..., ledger.App]) -> ledger.App:
    """The ledger app with every effect (``ways``) on a topic of two partitions, as
    ``tests.apps.ledger:effects`` is in a process given ``app.env``. A test module whose app
    differs defines its own ``app``."""
    return new_ledger(2, ways=True)


@pytest.fixture
def progress_prefix(kafka_admin: AdminClient) -> Iterator[str]:
    """A transactional id prefix of this test's own, with its compacted progress topic (what
    ``oncely topics ensure --exactly-once`` creates)."""
    name = f"test-{uuid.uuid4().hex}"
    topic = progress_topic(name)
    spec = NewTopic(
        topic, num_partitions=1, replication_factor=1, config={"cleanup.policy": "compact"}
    )
    kafka_admin.create_topics([spec])[topic].result(30)
    yield name
    kafka_admin.delete_topics([topic])[topic].result(30)


@pytest.fixture(params=["at-least-once", "exactly-once"])
def relay_mode(request: pytest.FixtureRequest) -> dict[str, object]:
    """The relay settings of each mode, for a test that must hold in both: none at least once;
    exactly once, a transactional id prefix of the test's own with its progress topic
    (:func:`progress_prefix`). Such a test reads its topics with ``read_committed``."""
    if request.param == "at-least-once":
        return {}
    prefix: str = request.getfixturevalue("progress_prefix")
    return {"exactly_once": True, "transactional_id_prefix": prefix}
