"""The committed catalog in a Confluent-compatible schema registry: registering every version of
each ``avro-confluent`` event type under its subject, and asking the registry whether the code's
schema is compatible with what it holds.

Registration is a deploy step (``oncely schemas register``), run before the code that stages a
new version: ``stage()`` then only looks schema ids up. Versions are registered oldest first,
each as the exact text ``stage()`` sends (:func:`~oncely.schemas.confluent.schema_text`; for the
code's own version, the code's schema), so registering again finds the same ids. The registry
checks each new version against its compatibility level for the subject (Confluent's default is
``BACKWARD``, Apicurio's ``NONE``: set the level you mean, e.g. ``FULL``, on the registry).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from oncely.errors import OncelyError
from oncely.events import EventType, Registry
from oncely.schemas.catalog import SchemaCatalog
from oncely.schemas.confluent import NOT_REGISTERED_CODES, schema_text, subject_of
from oncely.schemas.errors import CatalogError

__all__ = [
    "IncompatibleVersionError",
    "Registration",
    "RegistrationResult",
    "RegistryUnavailableError",
    "RegistryVerdict",
    "check_registry",
    "confluent_types",
    "register_catalog",
]

_CONFLICT = 409


class RegistryUnavailableError(OncelyError):
    """The schema registry could not be reached, or failed to answer (not a refusal)."""


class IncompatibleVersionError(OncelyError):
    """The schema registry refused a version as incompatible with the subject's versions."""


class RegistrationResult(StrEnum):
    """What :func:`register_catalog` found or did for one version."""

    REGISTERED = "registered"
    EXISTS = "exists"
    MISSING = "missing"
    """Not registered, and not registered now (a dry run)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """One version of an event type under its subject; ``schema_id`` is ``None`` when missing."""

    event_type: str
    version: int
    subject: str
    schema_id: int | None
    outcome: RegistrationResult


@dataclass(frozen=True, slots=True)
class RegistryVerdict:
    """The registry's answer for the code's schema of one event type: ``compatible`` with the
    latest version of ``subject`` under the subject's compatibility level, or ``None`` when the
    subject holds no version yet (nothing to break)."""

    event_type: str
    version: int
    subject: str
    compatible: bool | None


def confluent_types(registry: Registry) -> list[EventType[Any]]:
    """The ``avro-confluent`` event types of ``registry``, by name."""
    return sorted((t for t in registry if t.encoding == "avro-confluent"), key=lambda t: t.name)


def _versions(event_type: EventType[Any], catalog: SchemaCatalog) -> Iterator[tuple[int, str]]:
    """``(version, schema text)`` of every committed version of ``event_type``, oldest first,
    the code's version with the code's schema text."""
    committed = catalog.versions(event_type.name)
    if event_type.version not in {entry.version for entry in committed}:
        raise CatalogError(
            f"event type {event_type.name!r} v{event_type.version} is not in the schema catalog"
            f"{f' {catalog.directory}' if catalog.directory else ''}: run `oncely schemas "
            "export` and commit it before registering"
        )
    for entry in committed:
        schema = event_type.schema if entry.version == event_type.version else entry.schema
        yield entry.version, schema_text(schema)


def register_catalog(
    client: SchemaRegistryClient,
    registry: Registry,
    catalog: SchemaCatalog,
    *,
    dry_run: bool = False,
) -> Iterator[Registration]:
    """Register every committed version of each ``avro-confluent`` type of ``registry``, oldest
    first, and yield each one's outcome as it goes (``dry_run``: look up only).

    Idempotent: a version already registered is found (``exists``) with its id.

    Raises:
        CatalogError: an event type's code version is not committed (checked for every type
            before anything is registered).
        IncompatibleVersionError: the registry refused a version as incompatible (names the
            subject and version); the versions before it stay registered.
        RegistryUnavailableError: the registry could not be reached or failed.
    """
    plan = [
        (event_type, version, text)
        for event_type in confluent_types(registry)
        for version, text in list(_versions(event_type, catalog))
    ]
    for event_type, version, text in plan:
        subject = subject_of(event_type)
        schema = Schema(text, "AVRO")
        with _registry_failures(f"subject {subject!r} v{version}"):
            found = _lookup(client, subject, schema)
        if found is not None or dry_run:
            outcome = RegistrationResult.MISSING if found is None else RegistrationResult.EXISTS
            yield Registration(event_type.name, version, subject, found, outcome)
            continue
        with _registry_failures(f"subject {subject!r} v{version}"):
            schema_id = _register(client, subject, schema, f"{event_type.name!r} v{version}")
        yield Registration(
            event_type.name, version, subject, schema_id, RegistrationResult.REGISTERED
        )


def check_registry(
    client: SchemaRegistryClient, event_types: Iterable[EventType[Any]]
) -> list[RegistryVerdict]:
    """Ask the registry's compatibility endpoint (``POST /compatibility/subjects/<subject>/
    versions/latest``) about the code's schema of each ``avro-confluent`` type of
    ``event_types`` whose subject holds a version (the others get ``compatible=None``).

    Raises :class:`RegistryUnavailableError` when the registry could not be reached or failed.
    """
    verdicts = []
    for event_type in event_types:
        if event_type.encoding != "avro-confluent":
            continue
        subject = subject_of(event_type)
        schema = Schema(schema_text(event_type.schema), "AVRO")
        compatible: bool | None
        with _registry_failures(f"subject {subject!r}"):
            try:  # asked first: registries answer differently for a subject they do not hold
                client.get_versions(subject)
            except SchemaRegistryError as exc:
                if exc.error_code not in NOT_REGISTERED_CODES:
                    raise
                compatible = None
            else:
                compatible = client.test_compatibility(subject, schema)
        verdicts.append(RegistryVerdict(event_type.name, event_type.version, subject, compatible))
    return verdicts


def _register(client: SchemaRegistryClient, subject: str, schema: Schema, what: str) -> int:
    """Register ``schema`` under ``subject``; :class:`IncompatibleVersionError` on a refusal."""
    try:
        return client.register_schema(subject, schema)
    except SchemaRegistryError as exc:
        if exc.http_status_code != _CONFLICT:
            raise
        raise IncompatibleVersionError(
            f"the schema registry refused {what} under subject {subject!r} as incompatible "
            f"with the versions it holds: {exc.error_message}"
        ) from None


def _lookup(client: SchemaRegistryClient, subject: str, schema: Schema) -> int | None:
    """The id of ``schema`` under ``subject``, or ``None`` when it is not registered there."""
    try:
        return client.lookup_schema(subject, schema).schema_id
    except SchemaRegistryError as exc:
        if exc.error_code in NOT_REGISTERED_CODES:
            return None
        raise


@contextlib.contextmanager
def _registry_failures(what: str) -> Iterator[None]:
    """Turn a registry failure while working on ``what`` (an HTTP error other than the ones the
    caller handles, a transport error) into :class:`RegistryUnavailableError`."""
    try:
        yield
    except SchemaRegistryError as exc:
        raise RegistryUnavailableError(f"the schema registry failed on {what}: {exc}") from exc
    except _transport_errors() as exc:
        raise RegistryUnavailableError(
            f"the schema registry could not be reached ({what}): {type(exc).__name__}: {exc}; "
            "check ONCELY_SCHEMA_REGISTRY_URL and its TLS settings"
        ) from exc


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of the HTTP client confluent-kafka uses (httpx2, else httpx)."""
    errors: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)
