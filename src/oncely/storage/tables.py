"""oncely's tables as SQLAlchemy Core ``MetaData``: the canonical schema.

The packaged migrations (applied by ``oncely db upgrade``, or from your Alembic revisions by
:mod:`oncely.alembic`) build the same database as :data:`metadata` (or :func:`build_metadata`
for a named schema); a test proves it. Table, column and constraint names are part of the
contract: errors are translated by constraint name (:mod:`oncely.storage.errors`), Debezium's
Outbox Event Router reads the outbox columns by name, and every table's name starts with
``oncely_`` (:mod:`oncely.alembic`'s filters rely on it).
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from oncely.errors import ConfigurationError

#: Shards of a new installation (``oncely db upgrade --shards`` chooses another count).
DEFAULT_SHARDS = 32
#: The most shards an installation can have.
MAX_SHARDS = 1024
#: Why a key is parked: its next row failed for good, is not due yet, or its topic is missing
#: (or not authorised) and the relay waits for it to exist.
PARK_REASONS = ("dead", "delayed", "blocked")
#: What an operator asked for a parked key: publish its dead row again, or give up on it.
PARK_REQUESTS = ("requeue", "skip")
TASK_STATUSES = ("queued", "leased", "completed", "dead", "failed", "stale", "expired")
#: Task states nothing leaves on its own; purged after the retention period. ``stale`` is not
#: terminal: it waits for an operator's ``oncely tasks reclaim``.
TASK_TERMINAL_STATUSES = ("completed", "dead", "failed", "expired")
TASK_POLICIES = ("retry_safe", "irreversible")
IDEMPOTENCY_STATUSES = ("processing", "accepted", "rejected")
#: Where an audited operation was asked: the command line or the console.
AUDIT_VIA = ("cli", "web")
IDEMPOTENCY_KEY_MAX = 200

#: The channel a statement-level trigger notifies after an insert into the outbox while a relay
#: listens (``oncely_relay_members.asleep``: see :mod:`oncely.relay.pace`), delivered at commit.
NOTIFY_CHANNEL = "oncely_outbox"
#: The channel notified at commit after every insert into ``oncely_tasks``: task workers LISTEN.
TASKS_NOTIFY_CHANNEL = "oncely_tasks"
#: The column of the outbox and the tasks holding the trace context staged with a row (Java
#: properties text, :func:`oncely.wire.trace_context_text`); the outbox's is the column
#: Debezium's Outbox Event Router reads by default (``tracing.span.context.field``).
TRACE_CONTEXT_COLUMN = "tracingspancontext"

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def validate_schema_name(schema: str) -> str:
    """Return ``schema`` if it is a plain lower-case PostgreSQL identifier, else raise.

    Raises :class:`ConfigurationError` naming the value: oncely never builds SQL from an
    unvalidated identifier.
    """
    if not _IDENTIFIER.fullmatch(schema):
        raise ConfigurationError(
            f"schema name {schema!r} is not a plain identifier: use 1-63 characters of "
            "lower-case letters, digits and '_', not starting with a digit"
        )
    if schema.startswith("pg_"):
        raise ConfigurationError(
            f"schema name {schema!r}: the prefix 'pg_' is reserved for PostgreSQL's own schemas"
        )
    return schema


def _ddl(statement: str) -> sa.DDL:
    return sa.DDL(statement)  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _any(column: str, values: tuple[str, ...]) -> str:
    """``column = ANY (ARRAY[...])`` as PostgreSQL prints it back, for partial index predicates."""
    return f"{column} = ANY (ARRAY[{', '.join(f'{v!r}::text' for v in values)}])"


class XID8(sa.types.UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (``pg_current_xact_id()``)."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "xid8"


class PG_SNAPSHOT(sa.types.UserDefinedType[str]):  # noqa: N801  # the PostgreSQL type's name
    """PostgreSQL's ``pg_snapshot`` (``xmin:xmax:xip,...``), read and written as text."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "pg_snapshot"


def shard_expression(shards: int) -> str:
    """SQL of a row's shard: the first 28 bits of ``md5(topic, 0x1f, aggregateid)`` mod ``shards``.

    md5 is stable across PostgreSQL versions (``hashtext`` is not);
    :func:`shard_of` computes the same in Python.
    """
    return (
        "mod((('x'::text || substr(md5(((topic || chr(31)) || aggregateid)), 1, 7)))::bit(28)"
        f"::integer, {shards})"
    )


def shard_of(topic: str, aggregateid: str, shards: int) -> int:
    """The shard PostgreSQL computes for a row of ``topic`` and key ``aggregateid``."""
    digest = hashlib.md5(f"{topic}\x1f{aggregateid}".encode(), usedforsecurity=False)
    return int(digest.hexdigest()[:7], 16) % shards


def _wake_on_insert(table: sa.Table, prefix: str) -> None:
    """Create (and drop) the trigger that notifies a sleeping relay after inserts; its function
    names ``oncely_relay_members`` by schema (no per-call search_path), as migration 0006."""
    function = f"{prefix}{table.name}_wake"
    schema = f"'{prefix[:-1]}'" if prefix else "current_schema()"
    sa.event.listen(
        table,
        "after_create",
        _ddl(
            "DO $do$ BEGIN EXECUTE "
            f"'CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $body$ BEGIN "
            f"IF EXISTS (SELECT 1 FROM ' || quote_ident({schema}) || '.oncely_relay_members "
            f"WHERE asleep) THEN PERFORM pg_notify(''{NOTIFY_CHANNEL}'', ''''); "
            "END IF; RETURN NULL; END $body$'; END $do$"
        ),
    )
    sa.event.listen(
        table,
        "after_create",
        _ddl(
            f"CREATE TRIGGER {table.name}_wake AFTER INSERT ON {prefix}{table.name} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        ),
    )
    sa.event.listen(table, "after_drop", _ddl(f"DROP FUNCTION IF EXISTS {function}()"))


def _notify_on_insert(table: sa.Table, prefix: str, channel: str) -> None:
    """Create (and drop) a statement-level trigger that notifies ``channel`` after inserts."""
    function = f"{prefix}{table.name}_notify"
    sa.event.listen(
        table,
        "after_create",
        _ddl(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$"
        ),
    )
    sa.event.listen(
        table,
        "after_create",
        _ddl(
            f"CREATE TRIGGER {table.name}_notify AFTER INSERT ON {prefix}{table.name} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        ),
    )
    sa.event.listen(table, "after_drop", _ddl(f"DROP FUNCTION IF EXISTS {function}()"))


def _forget_kept_keys(table: sa.Table, prefix: str) -> None:
    """Create (and drop) the trigger that frees the idempotency keys of deleted kept rows, from
    the text of migration 0009, its one definition (the schema named as ``_wake_on_insert``)."""
    text = resources.files(__package__).joinpath("migrations", "0009_kept_rows.sql").read_text()
    function = text[text.index("DO $do$") : text.index("END $do$;") + len("END $do$")]
    trigger = text[text.index("CREATE TRIGGER") :].strip().removesuffix(";")
    if prefix:
        schema = f"'{prefix[:-1]}'"
        function = function.replace("current_schema()", schema).replace(
            "FUNCTION oncely_relay_kept_forget()", f"FUNCTION {prefix}oncely_relay_kept_forget()"
        )
        trigger = trigger.replace(" ON oncely_relay_kept", f" ON {prefix}oncely_relay_kept")
        trigger = trigger.replace(
            "FUNCTION oncely_relay_kept_forget()", f"FUNCTION {prefix}oncely_relay_kept_forget()"
        )
    sa.event.listen(table, "after_create", _ddl(function))
    sa.event.listen(table, "after_create", _ddl(trigger))
    sa.event.listen(
        table, "after_drop", _ddl(f"DROP FUNCTION IF EXISTS {prefix}oncely_relay_kept_forget()")
    )


#: The argument types of ``oncely_passed`` (a function is dropped by its signature).
PASSED_SIGNATURE = "xid8, bigint, pg_snapshot, pg_snapshot, bigint"


def _passed_rule(table: sa.Table, prefix: str) -> None:
    """Create (and drop) ``oncely_passed``, "the shard's progress has passed this row", from the
    text of migration 0007, its one definition."""
    text = resources.files(__package__).joinpath("migrations", "0007_passed_rule.sql").read_text()
    create = text[text.index("CREATE OR REPLACE FUNCTION") :].strip().removesuffix(";")
    create = create.replace("FUNCTION oncely_passed(", f"FUNCTION {prefix}oncely_passed(", 1)
    sa.event.listen(table, "after_create", _ddl(create))
    sa.event.listen(
        table,
        "after_drop",
        _ddl(f"DROP FUNCTION IF EXISTS {prefix}oncely_passed({PASSED_SIGNATURE})"),
    )


def build_metadata(schema: str | None = None) -> sa.MetaData:
    """The oncely tables, in ``schema`` (``None``: the connection's ``search_path``)."""
    if schema is not None:
        validate_schema_name(schema)
    md = sa.MetaData(schema=schema)
    now = sa.text("now()")

    outbox = sa.Table(
        "oncely_outbox",
        md,
        sa.Column("id", UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("aggregatetype", sa.Text, nullable=False),
        sa.Column("aggregateid", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("headers", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("event_key", sa.Text, nullable=False),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("txid", XID8, nullable=False, server_default=sa.text("pg_current_xact_id()")),
        sa.Column(
            "shard",
            sa.SmallInteger,
            sa.Computed(shard_expression(DEFAULT_SHARDS), persisted=True),
            nullable=False,
        ),
        # Migration 0004: the trace context staged with the row (see oncely.wire).
        sa.Column(TRACE_CONTEXT_COLUMN, sa.Text),
        sa.PrimaryKeyConstraint("id", name="oncely_outbox_pkey"),
        sa.UniqueConstraint("event_key", name="oncely_outbox_event_key_key"),
    )
    # The relay's snapshot reads: one shard's rows by writing transaction.
    sa.Index("oncely_outbox_shard_txid_idx", outbox.c.shard, outbox.c.txid)
    prefix = f"{schema}." if schema else ""

    shards = sa.Table(
        "oncely_relay_shards",
        md,
        # Not a serial: the shards are numbered 0..S-1 when the table is created.
        sa.Column("shard", sa.SmallInteger, nullable=False, autoincrement=False),
        sa.Column("done", PG_SNAPSHOT, nullable=False),
        sa.Column("reading", PG_SNAPSHOT),
        sa.Column("after_seq", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("owner", sa.Text),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("shard", name="oncely_relay_shards_pkey"),
    )
    sa.event.listen(
        shards,
        "after_create",
        _ddl(
            f"INSERT INTO {prefix}oncely_relay_shards (shard, done) "
            f"SELECT n, pg_current_snapshot() FROM generate_series(0, {DEFAULT_SHARDS - 1}) AS n"
        ),
    )
    _passed_rule(shards, prefix)
    sa.Table(
        "oncely_relay_members",
        md,
        sa.Column("relay_id", sa.Text, nullable=False),
        sa.Column("heartbeat_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("asleep", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("exactly_once", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.PrimaryKeyConstraint("relay_id", name="oncely_relay_members_pkey"),
    )
    sa.Table(
        "oncely_relay_parked",
        md,
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("aggregateid", sa.Text, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column("event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("until", sa.DateTime(timezone=True)),
        sa.Column("request", sa.Text),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        # Migration 0013: a dead row's attempts and its first failure (the last is parked_at).
        sa.Column("attempts", sa.Integer),
        sa.Column("first_failed_at", sa.DateTime(timezone=True)),
        sa.PrimaryKeyConstraint("topic", "aggregateid", name="oncely_relay_parked_pkey"),
        sa.CheckConstraint(_in("reason", PARK_REASONS), name="oncely_relay_parked_reason_check"),
        sa.CheckConstraint(_in("request", PARK_REQUESTS), name="oncely_relay_parked_request_check"),
    )
    held = sa.Table(
        "oncely_relay_held",
        md,
        sa.Column("position", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("aggregateid", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("position", name="oncely_relay_held_pkey"),
        sa.ForeignKeyConstraint(
            ["topic", "aggregateid"],
            ["oncely_relay_parked.topic", "oncely_relay_parked.aggregateid"],
            name="oncely_relay_held_key_fkey",
        ),
    )
    sa.Index("oncely_relay_held_key_idx", held.c.topic, held.c.aggregateid, held.c.position)
    # Migration 0009: the rows of parked keys kept aside when retention dropped their partition.
    kept = sa.Table(
        "oncely_relay_kept",
        md,
        sa.Column("id", UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("aggregatetype", sa.Text, nullable=False),
        sa.Column("aggregateid", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("headers", JSONB, nullable=False),
        sa.Column("event_key", sa.Text, nullable=False),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("txid", XID8, nullable=False),
        sa.Column("shard", sa.SmallInteger, nullable=False, autoincrement=False),
        sa.Column(TRACE_CONTEXT_COLUMN, sa.Text),
        sa.Column("kept_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("id", name="oncely_relay_kept_pkey"),
    )
    sa.Index("oncely_relay_kept_key_idx", kept.c.topic, kept.c.aggregateid)
    _forget_kept_keys(kept, prefix)
    # Migration 0012: rows given up with `oncely dead skip`, once the relay carried it out.
    sa.Table(
        "oncely_relay_skipped",
        md,
        sa.Column("event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("aggregateid", sa.Text, nullable=False),
        sa.Column("skipped_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("event_id", name="oncely_relay_skipped_pkey"),
    )
    _wake_on_insert(outbox, prefix)

    sa.Table(
        "oncely_receipts",
        md,
        sa.Column("event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("effect", sa.Text, nullable=False),
        sa.Column("topic", sa.Text),
        sa.Column("partition", sa.Integer),
        sa.Column("offset", sa.BigInteger),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("outcome", sa.Text, nullable=False, server_default=sa.text("'applied'::text")),
        sa.PrimaryKeyConstraint("event_id", "effect", name="oncely_receipts_pkey"),
        sa.Index("oncely_receipts_effect_applied_at_idx", "effect", "applied_at"),
    )

    # Migration 0012: records an effect's consumer dead-lettered (they get no receipt).
    sa.Table(
        "oncely_dead_lettered",
        md,
        sa.Column("event_id", UUID(as_uuid=True), nullable=False),
        sa.Column("effect", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("offset", sa.BigInteger, nullable=False, autoincrement=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column(
            "dead_lettered_at", sa.DateTime(timezone=True), nullable=False, server_default=now
        ),
        sa.PrimaryKeyConstraint("event_id", "effect", name="oncely_dead_lettered_pkey"),
    )

    # Migration 0008: retention's marks of Kafka's high watermarks (oncely.retention.guard).
    sa.Table(
        "oncely_retention_marks",
        md,
        sa.Column("receipts_partition", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False, autoincrement=False),
        sa.Column("high", sa.BigInteger, nullable=False),
        sa.Column("receipted", sa.BigInteger),
        sa.Column("marked_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint(
            "receipts_partition", "topic", "partition", name="oncely_retention_marks_pkey"
        ),
        sa.CheckConstraint("partition >= -1", name="oncely_retention_marks_partition_check"),
    )

    tasks = sa.Table(
        "oncely_tasks",
        md,
        sa.Column("id", UUID(as_uuid=True), nullable=False),
        sa.Column("task_key", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'queued'::text")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("expires_at", sa.DateTime(timezone=True)),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text),
        sa.Column("result", JSONB),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column(TRACE_CONTEXT_COLUMN, sa.Text),
        sa.PrimaryKeyConstraint("id", name="oncely_tasks_pkey"),
        sa.UniqueConstraint("task_key", name="oncely_tasks_task_key_key"),
        sa.CheckConstraint(_in("status", TASK_STATUSES), name="oncely_tasks_status_check"),
        sa.CheckConstraint(_in("policy", TASK_POLICIES), name="oncely_tasks_policy_check"),
    )
    sa.Index(
        "oncely_tasks_queued_idx",
        tasks.c.available_at,
        postgresql_where=sa.text("status = 'queued'"),
    )
    sa.Index(
        "oncely_tasks_leased_idx",
        tasks.c.lease_until,
        postgresql_where=sa.text("status = 'leased'"),
    )
    # Migration 0002: retention purge of terminal tasks, and the workers' wake-up call.
    sa.Index(
        "oncely_tasks_finished_at_idx",
        tasks.c.finished_at,
        postgresql_where=sa.text(_any("status", TASK_TERMINAL_STATUSES)),
    )
    _notify_on_insert(tasks, prefix, TASKS_NOTIFY_CHANNEL)

    sa.Table(
        "oncely_idempotency_keys",
        md,
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text),
        sa.Column("detail", sa.Text),
        sa.Column("result", JSONB),
        sa.Column("extra", JSONB),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.PrimaryKeyConstraint("owner", "key", name="oncely_idempotency_keys_pkey"),
        sa.CheckConstraint(
            _in("status", IDEMPOTENCY_STATUSES), name="oncely_idempotency_keys_status_check"
        ),
        sa.CheckConstraint(
            f"char_length(key) <= {IDEMPOTENCY_KEY_MAX}",
            name="oncely_idempotency_keys_key_check",
        ),
    )
    # Migration 0011: the operators' audit log (oncely.storage.stores.audit).
    sa.Table(
        "oncely_audit",
        md,
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("via", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''::text")),
        sa.PrimaryKeyConstraint("id", name="oncely_audit_pkey"),
        sa.CheckConstraint(_in("via", AUDIT_VIA), name="oncely_audit_via_check"),
        sa.Index("oncely_audit_at_idx", "at"),
    )
    return md


#: The oncely tables in the connection's default schema.
metadata = build_metadata()
outbox = metadata.tables["oncely_outbox"]
receipts = metadata.tables["oncely_receipts"]
tasks = metadata.tables["oncely_tasks"]
idempotency_keys = metadata.tables["oncely_idempotency_keys"]
