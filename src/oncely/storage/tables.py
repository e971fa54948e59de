"""oncely's tables as SQLAlchemy Core ``MetaData``: the canonical schema.

Include :data:`metadata` (or :func:`build_metadata` for a named schema) in your own Alembic
environment, or let ``oncely db upgrade`` apply the packaged migrations; a test proves both give
the same database. Table, column and constraint names are part of the contract: errors are
translated by constraint name (:mod:`oncely.storage.errors`) and Debezium's Outbox Event Router
reads the outbox columns by name.
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from oncely.errors import ConfigurationError

OUTBOX_STATUSES = ("pending", "published", "dead", "skipped")
TASK_STATUSES = ("queued", "leased", "completed", "dead", "failed", "stale", "expired")
#: Task states nothing leaves on its own; purged after the retention period. ``stale`` is not
#: terminal: it waits for an operator's ``oncely tasks reclaim``.
TASK_TERMINAL_STATUSES = ("completed", "dead", "failed", "expired")
TASK_POLICIES = ("retry_safe", "irreversible")
IDEMPOTENCY_STATUSES = ("processing", "accepted", "rejected")
IDEMPOTENCY_KEY_MAX = 200

#: The channel a statement-level trigger notifies after every insert into the outbox, delivered
#: at commit: an idle relay LISTENing on it wakes at once, whoever wrote the rows.
NOTIFY_CHANNEL = "oncely_outbox"
#: The channel notified at commit after every insert into ``oncely_tasks``: task workers LISTEN.
TASKS_NOTIFY_CHANNEL = "oncely_tasks"

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
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'::text")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text),
        sa.Column("published_at", sa.DateTime(timezone=True)),
        sa.Column("kafka_partition", sa.Integer),
        sa.Column("kafka_offset", sa.BigInteger),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("id", name="oncely_outbox_pkey"),
        sa.UniqueConstraint("event_key", name="oncely_outbox_event_key_key"),
        sa.CheckConstraint(_in("status", OUTBOX_STATUSES), name="oncely_outbox_status_check"),
    )
    # The relay claims due rows in seq order, and checks each key's head among unsettled rows.
    sa.Index(
        "oncely_outbox_pending_seq_idx",
        outbox.c.seq,
        postgresql_where=sa.text("status = 'pending'"),
    )
    sa.Index(
        "oncely_outbox_key_seq_idx",
        outbox.c.aggregateid,
        outbox.c.seq,
        postgresql_where=sa.text("status = ANY (ARRAY['pending'::text, 'dead'::text])"),
    )
    sa.Index(
        "oncely_outbox_published_at_idx",
        outbox.c.published_at,
        postgresql_where=sa.text("status = 'published'"),
    )
    prefix = f"{schema}." if schema else ""
    _notify_on_insert(outbox, prefix, NOTIFY_CHANNEL)

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
    return md


#: The oncely tables in the connection's default schema.
metadata = build_metadata()
outbox = metadata.tables["oncely_outbox"]
receipts = metadata.tables["oncely_receipts"]
tasks = metadata.tables["oncely_tasks"]
idempotency_keys = metadata.tables["oncely_idempotency_keys"]
