"""Where the test services come from: environment, then testcontainers, then the devstack.

1. ``ONCELY_TEST_KAFKA`` and ``ONCELY_TEST_DATABASE_URL`` (both set): services you run yourself.
2. testcontainers, when a Docker engine answers (the Docker API at ``DOCKER_HOST``, or the
   default socket): ``ONCELY_TEST_KAFKA_IMAGE`` (default ``apache/kafka:4.1.0``) and
   ``ONCELY_TEST_POSTGRES_IMAGE`` (default ``postgres:18``), or images with their interfaces.
3. :class:`oncely.devstack.DevStack`: a real broker from Maven Central and embedded PostgreSQL.

``ONCELY_TEST_SERVICES`` makes the choice deterministic: ``testcontainers`` uses only 1 or 2
(and fails when no engine answers), ``devstack`` only 1 or 3, ``auto`` (the default) the order
above.

A schema registry (for ``avro-confluent`` event types) is provided on its own, only to the tests
that ask for it: ``ONCELY_TEST_SCHEMA_REGISTRY_URL`` (one you run yourself), else an Apicurio
Registry from Maven Central (:class:`oncely.devstack.registry.SchemaRegistryNode`, Java 21+).

:func:`provide_services` and :func:`provide_schema_registry` raise
:class:`ServicesUnavailableError` with every source's reason when none works; the pytest plugin
turns that into a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient
from sqlalchemy.engine import make_url

from oncely.devstack import DevStack
from oncely.devstack._process import free_port
from oncely.devstack.registry import DEFAULT_APICURIO_VERSION, SchemaRegistryNode
from oncely.errors import DevstackError, OncelyError


class ServicesUnavailableError(OncelyError):
    """No Kafka and PostgreSQL could be found or started for the tests."""


@dataclass(frozen=True, kw_only=True)
class Services:
    """A reachable Kafka and PostgreSQL.

    ``database_url`` is a SQLAlchemy URL (psycopg 3 driver) of a maintenance database on which
    the test may create and drop databases.
    """

    kafka_bootstrap: str
    kafka_version: str
    database_url: str
    postgres_version: str
    origin: str

    def describe(self) -> str:
        """One line naming the broker and the database, their versions and where they came
        from (the password hidden)."""
        return (
            f"Kafka {self.kafka_version} at {self.kafka_bootstrap}; "
            f"PostgreSQL {self.postgres_version} at "
            f"{make_url(self.database_url).render_as_string(hide_password=True)} ({self.origin})"
        )


def libpq_dsn(database_url: str) -> str:
    """A libpq connection string for a SQLAlchemy URL (drops the ``+driver`` part)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def postgres_version(database_url: str) -> str:
    with psycopg.connect(libpq_dsn(database_url), connect_timeout=10) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "unknown"


def _from_environment() -> Services | None:
    kafka = os.environ.get("ONCELY_TEST_KAFKA")
    database = os.environ.get("ONCELY_TEST_DATABASE_URL")
    if not (kafka and database):
        return None
    return Services(
        kafka_bootstrap=kafka,
        kafka_version="(external broker: version not reported)",
        database_url=database,
        postgres_version=postgres_version(database),
        origin="ONCELY_TEST_KAFKA / ONCELY_TEST_DATABASE_URL",
    )


#: ``ONCELY_TEST_SERVICES``'s values.
SOURCES = ("auto", "testcontainers", "devstack")
DEFAULT_KAFKA_IMAGE = "apache/kafka:4.1.0"
DEFAULT_POSTGRES_IMAGE = "postgres:18"


def _docker_engine_answers() -> str | None:
    """``None`` when a Docker engine answers testcontainers' client, else the reason it does not."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return "the `docker` package is not installed (pip install testcontainers)"
    try:
        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except DockerException as exc:
        where = os.environ.get("DOCKER_HOST", "the default socket")
        return f"no Docker engine answered at {where} ({exc})"
    return None


@contextlib.contextmanager
def _from_testcontainers() -> Iterator[Services]:
    from testcontainers.community.postgres import PostgresContainer
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    postgres = PostgresContainer(
        os.environ.get("ONCELY_TEST_POSTGRES_IMAGE", DEFAULT_POSTGRES_IMAGE), driver="psycopg"
    ).with_command("postgres -c wal_level=logical -c max_replication_slots=8 -c max_wal_senders=8")
    kafka_image = os.environ.get("ONCELY_TEST_KAFKA_IMAGE", DEFAULT_KAFKA_IMAGE)
    # The broker advertises the address clients reach it at, so the host port is chosen first
    # and mapped to the same port in the container.
    port = free_port()
    kafka = (
        DockerContainer(kafka_image)
        .with_envs(
            KAFKA_NODE_ID="1",
            KAFKA_PROCESS_ROLES="broker,controller",
            KAFKA_LISTENERS=f"PLAINTEXT://0.0.0.0:{port},CONTROLLER://0.0.0.0:9093",
            KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://127.0.0.1:{port}",
            KAFKA_LISTENER_SECURITY_PROTOCOL_MAP="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            KAFKA_CONTROLLER_LISTENER_NAMES="CONTROLLER",
            KAFKA_CONTROLLER_QUORUM_VOTERS="1@localhost:9093",
            KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR="1",
            KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR="1",
            KAFKA_TRANSACTION_STATE_LOG_MIN_ISR="1",
            KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR="1",
            KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR="1",
            KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS="0",
            KAFKA_AUTO_CREATE_TOPICS_ENABLE="false",
        )
        .with_bind_ports(port, port)
        .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120))
    )
    with postgres, kafka:
        url = postgres.get_connection_url()
        bootstrap = f"127.0.0.1:{port}"
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=60)  # it answers
        yield Services(
            kafka_bootstrap=bootstrap,
            kafka_version=f"{kafka_image} (testcontainers)",
            database_url=url,
            postgres_version=postgres_version(url),
            origin="testcontainers",
        )


@contextlib.contextmanager
def provide_services() -> Iterator[Services]:
    """Yield the first source of Kafka and PostgreSQL that works, stopping it afterwards."""
    reasons: list[str] = []
    try:
        from_env = _from_environment()
    except psycopg.Error as exc:
        raise ServicesUnavailableError(
            f"ONCELY_TEST_DATABASE_URL is set but PostgreSQL did not answer: {exc}"
        ) from exc
    if from_env is not None:
        yield from_env
        return
    reasons.append("ONCELY_TEST_KAFKA / ONCELY_TEST_DATABASE_URL are not both set")
    source = os.environ.get("ONCELY_TEST_SERVICES", "auto")
    if source not in SOURCES:
        raise ServicesUnavailableError(
            f"ONCELY_TEST_SERVICES={source!r} is none of {', '.join(SOURCES)}"
        )
    if source == "devstack":
        reasons.append("ONCELY_TEST_SERVICES=devstack leaves testcontainers out")
    else:
        no_docker = _docker_engine_answers()
        if no_docker is None:
            with _from_testcontainers() as services:
                yield services
            return
        reasons.append(no_docker)
        if source == "testcontainers":
            raise ServicesUnavailableError(
                "no Kafka and PostgreSQL for the tests (ONCELY_TEST_SERVICES=testcontainers):\n- "
                + "\n- ".join(reasons)
            )
    stack = DevStack()
    try:
        info = stack.start()
    except DevstackError as exc:
        reasons.append(f"the devstack failed: {exc}")
        raise ServicesUnavailableError(
            "no Kafka and PostgreSQL for the tests:\n- " + "\n- ".join(reasons)
        ) from exc
    try:
        yield Services(
            kafka_bootstrap=info.kafka_bootstrap,
            kafka_version=info.kafka_version,
            database_url=info.database_url,
            postgres_version=info.postgres_version,
            origin="oncely devstack",
        )
    finally:
        stack.stop()


@dataclass(frozen=True, kw_only=True)
class SchemaRegistry:
    """A reachable Confluent-compatible schema registry: ``url`` is its API's base URL."""

    url: str
    origin: str

    def describe(self) -> str:
        return f"schema registry at {self.url} ({self.origin})"


@contextlib.contextmanager
def provide_schema_registry(data_dir: Path) -> Iterator[SchemaRegistry]:
    """Yield ``ONCELY_TEST_SCHEMA_REGISTRY_URL``'s registry, else an Apicurio Registry started
    with its data and log in ``data_dir`` (stopped afterwards)."""
    url = os.environ.get("ONCELY_TEST_SCHEMA_REGISTRY_URL")
    if url:
        yield SchemaRegistry(url=url, origin="ONCELY_TEST_SCHEMA_REGISTRY_URL")
        return
    node = SchemaRegistryNode(data_dir=data_dir)
    try:
        node.start()
    except DevstackError as exc:
        raise ServicesUnavailableError(
            "no schema registry for the tests: ONCELY_TEST_SCHEMA_REGISTRY_URL is not set and "
            f"Apicurio Registry could not be started: {exc}"
        ) from exc
    try:
        yield SchemaRegistry(
            url=node.url, origin=f"Apicurio Registry {DEFAULT_APICURIO_VERSION}, oncely devstack"
        )
    finally:
        node.stop()
