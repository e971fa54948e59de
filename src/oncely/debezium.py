"""Debezium mode: the connector configuration that relays ``oncely_outbox`` like oncely's relay.

Debezium's PostgreSQL connector reads the outbox INSERTs from the WAL (``pgoutput``) and its
Outbox Event Router turns each row into the record oncely's relay would produce:

- topic = the row's ``topic`` (``route.by.field=topic``), optionally rewritten by
  ``route.topic.regex`` / ``route.topic.replacement`` (a Java regex that must match the whole
  topic; a topic it does not match is used unchanged);
- key = ``aggregateid`` through ``StringConverter`` (UTF-8), so Kafka Connect's producer puts
  it on the partition ``murmur2(key)`` picks, as the relay's ``partitioner=murmur2_random``;
- value = the ``payload`` bytes as stored (``bytea`` through Kafka's ``ByteArrayConverter``);
- headers ``id`` (the uuid as 36 lowercase characters) then ``eventType`` (the ``type`` column).

What the router cannot reproduce is listed in ``docs/how-to/debezium.md``: the record timestamp
(Debezium's processing time, not ``created_at``), and the row's extra ``headers``: that column is
one ``jsonb`` value, which the router could only place whole, as a single JSON header, never as
one Kafka header per entry. oncely's consumers need neither.

UPDATEs (settles, requeues) and DELETEs (purges) are skipped by the connector
(``skipped.operations=u,d,t``; Debezium then creates the publication with
``publish = 'insert'``), so nothing is emitted for them, not even a tombstone
(``tombstones.on.delete=false`` as well). The router would drop them anyway, UPDATEs with a
warning per row.

The snapshot taken when the connector first starts reads only rows still ``pending``, in
``seq`` order, so switching from oncely's relay to Debezium publishes the backlog once and in
per-key order. In Debezium mode nothing settles a row: rows stay ``pending`` and are removed by
:func:`purge` (``oncely debezium purge``), not by the relay's purge of published rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from oncely.errors import ConfigurationError, OncelyError
from oncely.storage.queries import query
from oncely.storage.tables import validate_schema_name

OUTBOX_TABLE = "oncely_outbox"
CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
EVENT_ROUTER = "io.debezium.transforms.outbox.EventRouter"
STRING_CONVERTER = "org.apache.kafka.connect.storage.StringConverter"
BYTE_ARRAY_CONVERTER = "org.apache.kafka.connect.converters.ByteArrayConverter"
HEADER_CONVERTER = "org.apache.kafka.connect.storage.SimpleHeaderConverter"
#: The router's named group: ``route.topic.replacement`` refers to it as ``${routedByValue}``.
ROUTED_BY_VALUE = "${routedByValue}"
DEFAULT_ROUTE_REGEX = "(?<routedByValue>.*)"
DEFAULT_CONNECTOR_NAME = "oncely-outbox"
DEFAULT_SLOT_NAME = "oncely_outbox"
DEFAULT_PUBLICATION_NAME = "oncely_outbox"
DEFAULT_LOGICAL_NAME = "oncely"

Format = Literal["json", "properties"]

_IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
_NAME_CHARS = _IDENTIFIER_CHARS | frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ.-")
_MAX_IDENTIFIER = 63
_CONTROL_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}


class SlotInUseError(OncelyError):
    """The replication slot is still held by a running connector."""


def _check_identifier(what: str, name: str) -> str:
    """``name`` if it is a slot/publication name PostgreSQL takes as is, else raise."""
    if not (0 < len(name) <= _MAX_IDENTIFIER and set(name) <= _IDENTIFIER_CHARS):
        raise ConfigurationError(
            f"{what} {name!r}: use 1-{_MAX_IDENTIFIER} lower-case letters, digits and '_'"
        )
    return name


def _check_name(what: str, name: str) -> str:
    if not (name and set(name) <= _NAME_CHARS):
        raise ConfigurationError(f"{what} {name!r}: use letters, digits, '.', '_' and '-'")
    return name


@dataclass(frozen=True, kw_only=True)
class ConnectorOptions:
    """Everything the connector configuration depends on.

    Attributes:
        hostname, port, user, password, dbname: how Kafka Connect reaches PostgreSQL (from
            where Connect runs, e.g. ``postgres`` inside docker compose). The user needs the
            REPLICATION attribute and, for ``publication.autocreate.mode=filtered``, ownership
            of the outbox table (or superuser).
        sslmode: passed as ``database.sslmode`` when given.
        schema: the schema holding ``oncely_outbox``.
        name: the connector's name in Kafka Connect.
        logical_name: Debezium's ``topic.prefix``; names the connector's metrics and would
            prefix Debezium's own topics (heartbeats), never the routed event topics.
        topic_prefix: put in front of every routed topic (empty: the row's topic as is).
        route_regex: Java regex with the named group ``routedByValue``, matched against the
            whole ``topic`` column; the routed topic is ``topic_prefix + routedByValue``.
        slot_name, publication_name: the replication slot and publication Debezium uses.
        extended_headers: Debezium's ``extended.headers.enabled``; when true every record also
            carries ``__debezium.context.*`` headers before ``id``.

    Raises:
        ConfigurationError: a name PostgreSQL or Kafka Connect would refuse or misread, or a
            route regex without the ``routedByValue`` group (the message names the value).
    """

    hostname: str
    port: int = 5432
    user: str
    password: str | None = None
    dbname: str
    sslmode: str | None = None
    schema: str = "public"
    name: str = DEFAULT_CONNECTOR_NAME
    logical_name: str = DEFAULT_LOGICAL_NAME
    topic_prefix: str = ""
    route_regex: str = DEFAULT_ROUTE_REGEX
    slot_name: str = DEFAULT_SLOT_NAME
    publication_name: str = DEFAULT_PUBLICATION_NAME
    extended_headers: bool = False

    def __post_init__(self) -> None:
        validate_schema_name(self.schema)
        _check_identifier("slot name", self.slot_name)
        _check_identifier("publication name", self.publication_name)
        _check_name("connector name", self.name)
        _check_name("logical name", self.logical_name)
        if self.topic_prefix:
            _check_name("topic prefix", self.topic_prefix)
        if "(?<routedByValue>" not in self.route_regex:
            raise ConfigurationError(
                f"route regex {self.route_regex!r} has no named group (?<routedByValue>...): "
                "the routed topic is built from it"
            )

    @classmethod
    def from_database_url(cls, url: str, **options: Any) -> ConnectorOptions:
        """Options for the database of a SQLAlchemy (or libpq) URL, plus keyword ``options``.

        Raises:
            ConfigurationError: the URL lacks a host, user or database name, or an option is
                invalid (names what and why).
        """
        try:
            parsed = make_url(url)
        except sa.exc.ArgumentError as exc:
            raise ConfigurationError(f"database URL is not valid: {exc}") from exc
        if not (parsed.host and parsed.username and parsed.database):
            raise ConfigurationError(
                "the database URL needs a host, a user and a database name (Kafka Connect "
                "connects over TCP), e.g. postgresql+psycopg://user:secret@db:5432/app"
            )
        sslmode = parsed.query.get("sslmode")
        database = cls(
            hostname=parsed.host,
            port=parsed.port or 5432,
            user=parsed.username,
            password=parsed.password if isinstance(parsed.password, str) else None,
            dbname=parsed.database,
            sslmode=sslmode if isinstance(sslmode, str) else None,
        )
        return replace(database, **options)


def connector_config(options: ConnectorOptions) -> dict[str, str]:
    """The Debezium PostgreSQL connector configuration for ``oncely_outbox``.

    Converters are set on the connector, so the worker's defaults do not matter.
    """
    table = f"{options.schema}.{OUTBOX_TABLE}"
    database = {
        "database.hostname": options.hostname,
        "database.port": str(options.port),
        "database.user": options.user,
        **({"database.password": options.password} if options.password is not None else {}),
        "database.dbname": options.dbname,
        **({"database.sslmode": options.sslmode} if options.sslmode else {}),
    }
    return {
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",
        **database,
        "topic.prefix": options.logical_name,
        "plugin.name": "pgoutput",
        "slot.name": options.slot_name,
        "publication.name": options.publication_name,
        "publication.autocreate.mode": "filtered",
        "table.include.list": table,
        # First start: publish the rows not yet published, in per-key (seq) order.
        "snapshot.mode": "initial",
        "snapshot.select.statement.overrides": table,
        f"snapshot.select.statement.overrides.{table}": (
            f"SELECT * FROM {table} WHERE status = 'pending' ORDER BY seq"
        ),
        # Only INSERTs are events; settles, requeues and purges emit nothing.
        "skipped.operations": "u,d,t",
        "tombstones.on.delete": "false",
        "binary.handling.mode": "bytes",
        "extended.headers.enabled": str(options.extended_headers).lower(),
        "key.converter": STRING_CONVERTER,
        "value.converter": BYTE_ARRAY_CONVERTER,
        "header.converter": HEADER_CONVERTER,
        "transforms": "outbox",
        "transforms.outbox.type": EVENT_ROUTER,
        "transforms.outbox.table.field.event.id": "id",
        "transforms.outbox.table.field.event.key": "aggregateid",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.table.fields.additional.placement": "type:header:eventType",
        "transforms.outbox.route.by.field": "topic",
        "transforms.outbox.route.topic.regex": options.route_regex,
        "transforms.outbox.route.topic.replacement": options.topic_prefix + ROUTED_BY_VALUE,
        "transforms.outbox.route.tombstone.on.empty.payload": "false",
    }


def connector_request(options: ConnectorOptions) -> dict[str, object]:
    """The body of ``POST /connectors`` on the Kafka Connect REST API."""
    return {"name": options.name, "config": connector_config(options)}


def _escape_properties(text: str, *, key: bool) -> str:
    """Escape ``text`` for a Java ``.properties`` file (read as ISO-8859-1).

    Keys also escape the separators ``=``, ``:`` and spaces, and a leading ``#`` or ``!``.
    """
    escaped = []
    for index, char in enumerate(text):
        if char == "\\":
            escaped.append("\\\\")
        elif char in _CONTROL_ESCAPES:
            escaped.append(_CONTROL_ESCAPES[char])
        elif (key and char in "=: ") or (index == 0 and char in (" #!" if key else " ")):
            escaped.append("\\" + char)
        elif not " " <= char <= "~":
            utf16 = char.encode("utf-16-be")  # two code units beyond the BMP
            escaped.extend(
                f"\\u{int.from_bytes(utf16[i : i + 2], 'big'):04x}" for i in range(0, len(utf16), 2)
            )
        else:
            escaped.append(char)
    return "".join(escaped)


def to_properties(config: Mapping[str, str]) -> str:
    """``config`` as a Java ``.properties`` file (``ConnectStandalone``'s connector file)."""
    return "".join(
        f"{_escape_properties(key, key=True)}={_escape_properties(value, key=False)}\n"
        for key, value in config.items()
    )


def render(options: ConnectorOptions, output: Format) -> str:
    """The configuration as JSON (the REST API's request body) or as a properties file.

    The properties file starts with ``name=``, as ``ConnectStandalone`` expects.
    """
    if output == "json":
        return json.dumps(connector_request(options), indent=2) + "\n"
    return to_properties({"name": options.name, **connector_config(options)})


def slot_status(engine: sa.Engine, slot_name: str) -> dict[str, object] | None:
    """The replication slot's row (``active``, ``retained_wal_bytes``...), or ``None``."""
    params = {"slot_name": _check_identifier("slot name", slot_name)}
    with engine.connect() as conn:
        row = conn.execute(query("debezium_slot_status"), params).mappings().first()
    return dict(row) if row is not None else None


def drop_slot(engine: sa.Engine, slot_name: str, *, timeout: float = 30.0) -> bool:
    """Drop the connector's replication slot once no walsender holds it.

    An idle slot keeps every WAL segment from its position on, so drop it when the connector is
    removed for good (the next connector then snapshots the pending rows again). Waits up to
    ``timeout`` seconds for a stopping connector to let go of the slot. Returns whether a slot
    was dropped (``False``: there was none).

    Raises:
        SlotInUseError: the slot is still active after ``timeout`` seconds: stop the connector
            first.
    """
    deadline = time.monotonic() + timeout
    while True:
        status = slot_status(engine, slot_name)
        if status is None:
            return False
        if not status["active"]:
            with engine.begin() as conn:
                dropped = conn.execute(query("debezium_drop_slot"), {"slot_name": slot_name})
                if dropped.first() is not None:
                    return True
        if time.monotonic() > deadline:
            raise SlotInUseError(
                f"replication slot {slot_name!r} is still in use after {timeout:.0f} s: stop or "
                "delete the Debezium connector that reads it, then drop the slot"
            )
        time.sleep(0.2)


def purge(engine: sa.Engine, *, older_than_seconds: float, batch_size: int = 5000) -> int:
    """Delete outbox rows created more than ``older_than_seconds`` ago; return how many.

    For Debezium mode only, where rows are never marked published: every old row goes,
    whatever its status. Deletes in batches of ``batch_size``, one transaction each.
    """
    deleted = 0
    while True:
        with engine.begin() as conn:
            count = conn.execute(
                query("debezium_purge"),
                {"older_than": older_than_seconds, "batch_size": batch_size},
            ).rowcount
        deleted += count
        if count < batch_size:
            return deleted
