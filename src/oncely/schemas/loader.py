"""The codec a process builds from its settings: the code's schemas, the committed catalog and,
for ``avro-confluent``, the schema registry (:func:`schema_registry_client`).

A record is read with its writer schema, found by fingerprint in the catalog (``avro``) or by id
in the registry (``avro-confluent``), and resolved to the code's version of its event type by
Avro schema resolution: fields the writer lacked take their defaults, fields the code lacks are
dropped. JSON values are validated by the code's model, which does the same for compatible
models. The catalog folder is the one given (``--schemas-dir``, ``ONCELY_SCHEMAS_DIR``), else
``./schemas`` when that folder exists, else none: then only the code's own schemas are known.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from oncely.errors import ConfigurationError
from oncely.events import Registry
from oncely.schemas.catalog import SchemaCatalog
from oncely.schemas.codec import Codec
from oncely.settings import SchemaSettings

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

__all__ = ["DEFAULT_SCHEMAS_DIR", "codec_for", "find_catalog", "schema_registry_client"]

log = logging.getLogger(__name__)

DEFAULT_SCHEMAS_DIR = Path("schemas")
"""The catalog folder used when none is given and it exists (relative to the working directory)."""


def find_catalog(directory: Path | None) -> SchemaCatalog:
    """Load the catalog in ``directory``, else in ``./schemas`` if it exists, else an empty one.

    Raises:
        CatalogError: ``directory`` is given and does not exist, or a file in the folder is not
            a valid schema file (the message names it).
    """
    if directory is None:
        if not DEFAULT_SCHEMAS_DIR.is_dir():
            return SchemaCatalog()
        directory = DEFAULT_SCHEMAS_DIR
    return SchemaCatalog.load(directory)


def schema_registry_client(settings: SchemaSettings | None = None) -> SchemaRegistryClient:
    """The Confluent schema registry client of ``settings`` (default: from ``ONCELY_*``): its
    URL, basic credentials and TLS files (:meth:`SchemaSettings.schema_registry_config`).

    Raises :class:`ConfigurationError` when no URL is set, or naming the extra to install when
    the client's packages are missing (they come with ``oncely[confluent]``).
    """
    settings = settings if settings is not None else SchemaSettings()
    config = settings.schema_registry_config()
    try:
        from oncely.schemas.confluent import new_client
    except ImportError as exc:
        raise ConfigurationError(
            f"a schema registry needs the Confluent client's packages ({exc.name} is missing): "
            "pip install 'oncely[confluent]'"
        ) from None
    return new_client(config)


def codec_for(registry: Registry, settings: SchemaSettings | None = None) -> Codec:
    """A :class:`Codec` for ``registry`` that reads the versions the catalog and registry know.

    The codec of a producing process as well: ``stage(session, event, codec=codec)``; call
    :meth:`Codec.warm` at start-up so that no ``stage()`` looks a schema id up.

    Args:
        registry: the application's event types (the reader schemas).
        settings: the catalog folder and schema registry (URL, credentials, TLS,
            ``auto_register``); default: from ``ONCELY_*``.

    Raises:
        CatalogError: the catalog folder is missing or malformed, or one of its files holds
            another schema for a version the code declares.
        ConfigurationError: an event type uses ``avro-confluent`` and no schema registry URL is
            set (``ONCELY_SCHEMA_REGISTRY_URL``).
    """
    settings = settings if settings is not None else SchemaSettings()
    confluent_types = [t.name for t in registry if t.encoding == "avro-confluent"]
    if confluent_types and not settings.schema_registry_url:
        raise ConfigurationError(
            f"event types {', '.join(confluent_types)} use avro-confluent: set the schema "
            "registry URL (--schema-registry-url or ONCELY_SCHEMA_REGISTRY_URL)"
        )
    catalog = find_catalog(settings.schemas_dir)
    client = schema_registry_client(settings) if settings.schema_registry_url else None
    codec = Codec(
        registry=registry,
        catalog=catalog,
        schema_registry=client,
        auto_register=settings.schema_registry_auto_register,
    )
    if catalog.directory is None:
        log.info(
            "no schema catalog: records written with other schema versions cannot be decoded "
            "(set --schemas-dir or ONCELY_SCHEMAS_DIR, or run where ./schemas is)"
        )
    else:
        log.info(
            "schema catalog %s: %d schema(s) of %d event type(s)",
            catalog.directory,
            len(catalog),
            len(catalog.event_types()),
        )
    return codec
