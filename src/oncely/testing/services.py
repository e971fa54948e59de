"""Where the test services come from: environment, then testcontainers, then the devstack.

1. ``ONCELY_TEST_KAFKA`` and ``ONCELY_TEST_DATABASE_URL`` (both set): services you run yourself.
2. testcontainers, when a Docker engine answers.
3. :class:`oncely.devstack.DevStack`: a real broker from Maven Central and embedded PostgreSQL.

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
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from oncely.devstack import DevStack
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


def _docker_engine_answers() -> str | None:
    """``None`` when a Docker engine answers, else the reason it does not."""
    if shutil.which("docker") is None:
        return "no `docker` client on PATH"
    try:
        probe = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer within 10 s"
    if probe.returncode != 0:
        return f"no Docker engine answered ({probe.stderr.strip().splitlines()[-1:]})"
    return None


@contextlib.contextmanager
def _from_testcontainers() -> Iterator[Services]:
    from testcontainers.community.kafka import KafkaContainer
    from testcontainers.community.postgres import PostgresContainer

    postgres = PostgresContainer("postgres:18", driver="psycopg").with_command(
        "postgres -c wal_level=logical -c max_replication_slots=8 -c max_wal_senders=8"
    )
    kafka = KafkaContainer("confluentinc/cp-kafka:7.9.0").with_kraft()
    with postgres, kafka:
        url = postgres.get_connection_url()
        yield Services(
            kafka_bootstrap=kafka.get_bootstrap_server(),
            kafka_version="confluentinc/cp-kafka:7.9.0 (Apache Kafka 3.9)",
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
    no_docker = _docker_engine_answers()
    if no_docker is None:
        with _from_testcontainers() as services:
            yield services
        return
    reasons.append(no_docker)
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
