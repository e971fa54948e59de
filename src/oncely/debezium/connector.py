"""Debezium mode: the connector configuration that relays ``oncely_outbox`` like oncely's relay
(pure: no I/O; the slots and the purge are :mod:`oncely.debezium.slots`).

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

The trace context staged with a row (``tracingspancontext``, the router's default
``tracing.span.context.field``) continues through Debezium's tracing SMT when Kafka Connect has
the OpenTelemetry SDK: the record's ``traceparent`` is then a child of the staged context, as
the relay's is. With ``cloudevents_source`` the router places ``id``, ``type`` and
``created_at`` as ``ce_id``, ``ce_type`` and ``ce_time``, and Kafka Connect's ``InsertField`` and
``HeaderFrom`` add ``ce_source`` and ``ce_specversion``: the values
:func:`oncely.wire.cloudevents_headers` gives the relay's records.

Only INSERTs are events: the relay never updates an outbox row, and DELETEs (purges) are
skipped by the connector (``skipped.operations=u,d,t``; Debezium then creates the publication
with ``publish = 'insert'``), so nothing is emitted for them, not even a tombstone
(``tombstones.on.delete=false`` as well). The publication is created with
``publish_via_partition_root = true`` (``publish.via.partition.root``): a partitioned outbox
(:mod:`oncely.storage.partitions`) then streams its rows as ``oncely_outbox`` rows, whichever
partition holds them; the option changes nothing for an unpartitioned outbox, so a connector
configured before the conversion keeps its publication right after it. The extra columns
(``seq``, ``event_key``, ``txid``, ``shard``, ``created_at``, ``available_at``) are in the
change events but the router reads only the columns it is configured with. oncely's relay
tables (shard progress, parked keys, held rows) are not captured (``table.include.list``).

The snapshot taken when the connector first starts reads only the rows oncely's relay has not
published (:func:`snapshot_statement`: not yet covered by their shard's progress, or held
behind a parked key; never a dead row), in ``seq`` order, so switching from oncely's relay to
Debezium publishes the backlog once and in per-key order. In Debezium mode nothing records
progress: every row counts as unpublished and is removed by
:func:`oncely.debezium.slots.purge` (``oncely debezium purge``), not by the relay's purge. That
purge deletes only rows the connector's replication slot has confirmed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import javaproperties
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from oncely.errors import ConfigurationError
from oncely.storage.tables import TRACE_CONTEXT_COLUMN, validate_schema_name
from oncely.wire import CLOUDEVENTS_SPECVERSION, EVENT_TYPE_HEADER, check_cloudevents_source

OUTBOX_TABLE = "oncely_outbox"
CONNECTOR_CLASS = "io.debezium.connector.postgresql.PostgresConnector"
EVENT_ROUTER = "io.debezium.transforms.outbox.EventRouter"
STRING_CONVERTER = "org.apache.kafka.connect.storage.StringConverter"
BYTE_ARRAY_CONVERTER = "org.apache.kafka.connect.converters.ByteArrayConverter"
HEADER_CONVERTER = "org.apache.kafka.connect.storage.SimpleHeaderConverter"
#: The router's named group: ``route.topic.replacement`` refers to it as ``${routedByValue}``.
ROUTED_BY_VALUE = "${routedByValue}"
INSERT_FIELD = "org.apache.kafka.connect.transforms.InsertField$Value"
HEADER_FROM = "org.apache.kafka.connect.transforms.HeaderFrom$Value"
#: The name of the router's span (Debezium's ``tracing.operation.name``).
TRACING_OPERATION = "oncely-debezium-read"
DEFAULT_ROUTE_REGEX = "(?<routedByValue>.*)"
DEFAULT_CONNECTOR_NAME = "oncely-outbox"
DEFAULT_SLOT_NAME = "oncely_outbox"
DEFAULT_PUBLICATION_NAME = "oncely_outbox"
DEFAULT_LOGICAL_NAME = "oncely"

Format = Literal["json", "properties"]

_IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
_NAME_CHARS = _IDENTIFIER_CHARS | frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ.-")
_MAX_IDENTIFIER = 63


def check_identifier(what: str, name: str) -> str:
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
        cloudevents_source: add the CloudEvents binary-mode headers with this ``ce_source``
            (a URI-reference), as the relay does with ``ONCELY_RELAY_CLOUDEVENTS_SOURCE``.

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
    cloudevents_source: str | None = None

    def __post_init__(self) -> None:
        validate_schema_name(self.schema)
        check_identifier("slot name", self.slot_name)
        check_identifier("publication name", self.publication_name)
        _check_name("connector name", self.name)
        _check_name("logical name", self.logical_name)
        if self.topic_prefix:
            _check_name("topic prefix", self.topic_prefix)
        if self.cloudevents_source is not None:
            try:
                check_cloudevents_source(self.cloudevents_source)
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
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


def snapshot_statement(schema: str) -> str:
    """The connector's first snapshot: the outbox rows oncely's relay has not published.

    Those their shard's progress has not passed (``oncely_passed``, migration 0007), and those held
    behind a parked key or parked as delayed; not a dead row (``oncely dead`` still lists it).
    Held and delayed rows whose partition retention dropped are read from their kept copies
    (``oncely_relay_kept``), as outbox rows. In ``seq`` order, so each key's backlog is
    published in order. The connector's user needs ``SELECT`` on ``oncely_relay_shards``,
    ``oncely_relay_held``, ``oncely_relay_parked`` and ``oncely_relay_kept``.
    """
    validate_schema_name(schema)
    parked = (
        f"(SELECT h.event_id FROM {schema}.oncely_relay_held AS h) "
        f"OR {{row}}.id IN (SELECT p.event_id FROM {schema}.oncely_relay_parked AS p "
        "WHERE p.reason = 'delayed')"
    )
    return (
        f"SELECT * FROM {schema}.{OUTBOX_TABLE} AS o "
        f"WHERE EXISTS (SELECT 1 FROM {schema}.oncely_relay_shards AS s "
        "WHERE s.shard = o.shard "
        f"AND NOT {schema}.oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)) "
        f"OR o.id IN {parked.format(row='o')} "
        # A kept copy as an outbox row: its columns by name (the outbox's others NULL).
        f"UNION ALL SELECT (jsonb_populate_record(NULL::{schema}.{OUTBOX_TABLE}, to_jsonb(k))).* "
        f"FROM {schema}.oncely_relay_kept AS k WHERE k.id IN {parked.format(row='k')} "
        "ORDER BY seq"
    )


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
    placement = [f"type:header:{EVENT_TYPE_HEADER}"]
    transforms = {
        "transforms.outbox.type": EVENT_ROUTER,
        "transforms.outbox.table.field.event.id": "id",
        "transforms.outbox.table.field.event.key": "aggregateid",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.route.by.field": "topic",
        "transforms.outbox.route.topic.regex": options.route_regex,
        "transforms.outbox.route.topic.replacement": options.topic_prefix + ROUTED_BY_VALUE,
        "transforms.outbox.route.tombstone.on.empty.payload": "false",
        # The staged trace context: a child span and its traceparent when Connect has the
        # OpenTelemetry SDK; rows staged without one are not traced.
        "transforms.outbox.tracing.span.context.field": TRACE_CONTEXT_COLUMN,
        "transforms.outbox.tracing.operation.name": TRACING_OPERATION,
        "transforms.outbox.tracing.with.context.field.only": "true",
    }
    names = ["outbox"]
    if options.cloudevents_source is not None:
        # oncely.wire.cloudevents_headers: the router places three columns; the two constants
        # are put on Debezium's change event as string fields, then moved into headers, before
        # the router runs (InsertHeader would parse "1.0" as a number and send "1").
        placement += ["id:header:ce_id", "type:header:ce_type", "created_at:header:ce_time"]
        constants = {
            "ce_source": options.cloudevents_source,
            "ce_specversion": CLOUDEVENTS_SPECVERSION,
        }
        for header, value in constants.items():
            name = header.replace("_", "")
            transforms[f"transforms.{name}.type"] = INSERT_FIELD
            transforms[f"transforms.{name}.static.field"] = f"__oncely_{header}"
            transforms[f"transforms.{name}.static.value"] = value
        transforms["transforms.ceheaders.type"] = HEADER_FROM
        transforms["transforms.ceheaders.fields"] = ",".join(f"__oncely_{h}" for h in constants)
        transforms["transforms.ceheaders.headers"] = ",".join(constants)
        transforms["transforms.ceheaders.operation"] = "move"
        names = [*(h.replace("_", "") for h in constants), "ceheaders", *names]
    transforms["transforms.outbox.table.fields.additional.placement"] = ",".join(placement)
    return {
        "connector.class": CONNECTOR_CLASS,
        "tasks.max": "1",
        **database,
        "topic.prefix": options.logical_name,
        "plugin.name": "pgoutput",
        "slot.name": options.slot_name,
        "publication.name": options.publication_name,
        "publication.autocreate.mode": "filtered",
        # A partitioned outbox (oncely db upgrade --partition-every) is published as its root
        # table, oncely_outbox, not as its partitions (which table.include.list leaves out);
        # no effect on an unpartitioned one, so also right for a table converted later.
        "publish.via.partition.root": "true",
        "table.include.list": table,
        # First start: publish the rows oncely's relay has not, in per-key (seq) order.
        "snapshot.mode": "initial",
        "snapshot.select.statement.overrides": table,
        f"snapshot.select.statement.overrides.{table}": snapshot_statement(options.schema),
        # Only INSERTs are events; purges (DELETEs) emit nothing.
        "skipped.operations": "u,d,t",
        "tombstones.on.delete": "false",
        "binary.handling.mode": "bytes",
        "extended.headers.enabled": str(options.extended_headers).lower(),
        "key.converter": STRING_CONVERTER,
        "value.converter": BYTE_ARRAY_CONVERTER,
        "header.converter": HEADER_CONVERTER,
        "transforms": ",".join(names),
        **transforms,
    }


def connector_request(options: ConnectorOptions) -> dict[str, object]:
    """The body of ``POST /connectors`` on the Kafka Connect REST API."""
    return {"name": options.name, "config": connector_config(options)}


def to_properties(config: Mapping[str, str]) -> str:
    """``config`` as a Java ``.properties`` file (``ConnectStandalone``'s connector file), in
    order, escaped as ``java.util.Properties.load`` reads it (ASCII, ``\\uXXXX`` escapes)."""
    return javaproperties.dumps(config, timestamp=None)


def render(options: ConnectorOptions, output: Format) -> str:
    """The configuration as JSON (the REST API's request body) or as a properties file.

    The properties file starts with ``name=``, as ``ConnectStandalone`` expects.
    """
    if output == "json":
        return json.dumps(connector_request(options), indent=2) + "\n"
    return to_properties({"name": options.name, **connector_config(options)})
