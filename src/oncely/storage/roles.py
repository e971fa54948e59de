"""Least-privilege PostgreSQL GRANTs per oncely component, derived from the SQL it runs.

Each component (the services that stage events, the relay, the consumers, the task worker)
is described by the named statements it executes (``sql/*.sql``) and the rows it inserts
through SQLAlchemy (``stage()``, ``enqueue_task()``). :func:`privileges_of` reads a statement
and returns the privileges PostgreSQL checks for it; :func:`grant_statements` turns the union
into ``GRANT`` statements (``oncely db sql --roles``). A unit test checks that only the tables'
stores (:mod:`oncely.storage.stores`) run statements and that every statement a component's
part of them runs is in its list, so a new query cannot silently need a new grant.

Rules applied (PostgreSQL's): ``INSERT`` needs INSERT, and SELECT on the ``RETURNING``
columns and on the ``ON CONFLICT`` arbiter's columns; ``UPDATE`` and ``DELETE`` need their
own privilege plus SELECT (their ``WHERE`` reads the table); ``SELECT ... FOR UPDATE`` needs
UPDATE; reading a table needs SELECT. The NOTIFY triggers call ``pg_notify``, which any role
may; the outbox's trigger reads ``oncely_relay_members.asleep`` with the inserting role's
privileges, so the writer gets that column (:attr:`Component.trigger_reads`).

The partitioned outbox (:mod:`oncely.storage.partitions`) fills ``seq`` by ``nextval`` of the
plain sequence ``oncely_outbox_seq_seq``, which needs USAGE on it (:attr:`Component.sequences`).
It is granted whatever the layout: on an unpartitioned outbox ``seq`` is an identity column,
whose implicit sequence has that name (the grant is harmless there), so the same GRANTs hold
before and after a conversion. Its key guard and key clean-up triggers are ``SECURITY DEFINER``
functions: the roles that stage and purge need nothing on ``oncely_outbox_keys``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.schema import ColumnCollectionConstraint

from oncely.errors import ConfigurationError
from oncely.storage.queries import query
from oncely.storage.tables import metadata, validate_schema_name

__all__ = [
    "COMPONENTS",
    "Component",
    "Privileges",
    "component_privileges",
    "grant_statements",
    "privileges_of",
    "validate_role_name",
]

#: table -> privileges; a privilege is "INSERT", "UPDATE", "DELETE", "SELECT" (whole table)
#: or "SELECT:<column>" (one column).
Privileges = dict[str, set[str]]

_ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_TABLE = r"(oncely_[a-z_]+)"
_COMMENT = re.compile(r"--[^\n]*")


@dataclass(frozen=True)
class Component:
    """One oncely component: what it is, and the SQL it runs."""

    name: str
    purpose: str
    #: Named statements of ``sql/*.sql`` it executes.
    statements: tuple[str, ...]
    #: Tables it inserts rows into through SQLAlchemy, with the columns it always provides.
    inserts: Mapping[str, tuple[str, ...]]
    #: Columns read by the triggers its inserts fire (they run with the inserting role's
    #: privileges): table -> columns.
    trigger_reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Sequences its inserts draw from (``nextval`` needs USAGE on them).
    sequences: tuple[str, ...] = ()
    #: Tables its statements read only these columns of: it gets SELECT on them alone (so the
    #: consumer, which counts outbox rows, never reads a payload): table -> columns.
    column_reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


_OUTBOX_PROVIDED = ("id", "aggregatetype", "aggregateid", "type", "topic", "payload", "headers")
_TASK_PROVIDED = ("id", "task_key", "name", "payload", "policy", "max_attempts")

#: What the console's pages read: the status, parked rows, tasks, an event end to end, the
#: audit log.
_CONSOLE_READS = (
    "relay_backlog",
    "relay_shards",
    "ops_parked_by_topic",
    "ops_receipts_by_effect",
    "ops_tasks_by_status",
    "dead_list",
    "task_list",
    "lookup_event",
    "lookup_key",
    "lookup_caused",
    "lookup_receipts",
    "lookup_tasks",
    "lookup_dead_lettered",
    "dead_lettered_recent",
    "audit_list",
    # the completeness of the app's effects (the overview's panel)
    "completeness_bounds",
    "completeness_buckets",
    "completeness_missing",
)

COMPONENTS: dict[str, Component] = {
    "writer": Component(
        "writer",
        "services that stage events: stage(), stage_many(), enqueue_task(), IdempotencyKeys",
        (
            "outbox_stage",
            "idempotency_insert",
            "idempotency_get",
            "idempotency_reclaim",
            "idempotency_finish",
        ),
        # An AsyncSession's rows are inserted by its unit of work (the ORM).
        {"oncely_outbox": (*_OUTBOX_PROVIDED, "event_key"), "oncely_tasks": _TASK_PROVIDED},
        # The outbox's insert trigger asks whether a relay sleeps (then it sends a NOTIFY).
        {"oncely_relay_members": ("asleep",)},
        # The partitioned outbox's seq default (the identity's own sequence when unpartitioned).
        ("oncely_outbox_seq_seq",),
    ),
    "relay": Component(
        "relay",
        "`oncely relay run`: read shards by snapshot, record progress, lease shards, park keys, "
        "hold rows, purge",
        (
            "relay_snapshot",
            "relay_read",
            "relay_rows",
            "relay_record",
            "relay_park",
            "relay_hold",
            "relay_parked",
            "relay_held_of",
            "relay_unhold",
            "relay_unpark",
            "relay_unkeep",
            "relay_skipped",
            "relay_park_failed",
            "relay_heartbeat",
            "relay_sleep",
            "relay_leave",
            "relay_acquire",
            "relay_release",
            "relay_backlog",
            "relay_shards",
            "relay_purge",
            "relay_purge_preview",
        ),
        {},
    ),
    "consumer": Component(
        "consumer",
        "`oncely consume`: receipts, and the tasks effects enqueue (ctx.enqueue_task)",
        (
            "receipt_insert",
            "receipts_insert_many",
            "dead_lettered_record",
            # the completeness of its effects (ONCELY_COMPLETENESS_INTERVAL_SECONDS)
            "completeness_bounds",
            "completeness_buckets",
            "completeness_missing",
        ),
        {"oncely_tasks": _TASK_PROVIDED},
        # The completeness statements read the outbox's ids, types and progress columns only.
        column_reads={
            "oncely_outbox": ("id", "type", "shard", "txid", "seq", "created_at"),
        },
    ),
    "task_worker": Component(
        "task_worker",
        "`oncely tasks run` and DurableCommand(deliver=...): lease, settle, sweep, purge tasks",
        (
            "task_names_waiting",
            "task_lease",
            "task_lease_by_key",
            "task_complete",
            "task_retry",
            "task_dead",
            "task_renew",
            "task_expire_queued",
            "task_lapsed_leases",
            "task_settle_lapsed",
            "task_purge",
        ),
        {},
    ),
    "operator": Component(
        "operator",
        "people and jobs: `oncely status`, `verify`, `dead`, `replay --from-outbox`, "
        "`relay purge`, `receipts purge`, `debezium purge|drop-slot`, `tasks list|reclaim`",
        (
            # status
            "relay_backlog",
            "relay_shards",
            "ops_parked_by_topic",
            "ops_receipts_by_effect",
            "ops_tasks_by_status",
            "completeness_bounds",
            "completeness_buckets",
            "completeness_missing",
            # verify
            "verify_now",
            "verify_outbox_summary",
            "verify_stuck",
            "verify_published",
            "verify_effect_summary",
            "verify_not_applied",
            "verify_out_of_order",
            # replay --from-outbox
            "republish_summary",
            "republish_parked_keys",
            "republish_rows",
            # dead list|requeue|skip
            "dead_list",
            "dead_request",
            # relay purge, receipts purge, debezium purge
            "relay_purge",
            "relay_purge_preview",
            "receipts_purge",
            "receipts_purge_preview",
            "debezium_purge_slots",
            "debezium_purge_mark",
            "debezium_purge_preview",
            "debezium_purge_waiting",
            "debezium_purge",
            "debezium_slot_status",
            "debezium_drop_slot",
            # tasks list|reclaim
            "task_list",
            "task_get",
            "task_reclaim",
            # the audit log of dead, tasks reclaim, replay --from-outbox and the console
            "audit_insert",
            "audit_list",
            # the console (oncely web) with its actions
            *_CONSOLE_READS,
        ),
        {},
    ),
    "console": Component(
        "console",
        "a read-only `oncely web` (ONCELY_WEB_READ_ONLY=true): its pages, no action",
        _CONSOLE_READS,
        {},
    ),
}


def validate_role_name(role: str) -> str:
    """Return ``role`` if it is a plain lower-case PostgreSQL identifier.

    Raises :class:`ConfigurationError` naming the value otherwise: role names are printed into
    SQL, so nothing else is accepted (quoting is applied as well).
    """
    if not _ROLE_NAME.fullmatch(role):
        raise ConfigurationError(
            f"role name {role!r} is not a plain identifier: use 1-63 characters of "
            "lower-case letters, digits and '_', not starting with a digit"
        )
    return role


def privileges_of(sql: str) -> Privileges:
    """The table privileges PostgreSQL checks when running ``sql`` (one oncely statement)."""
    text = _COMMENT.sub("", sql)
    found: Privileges = defaultdict(set)
    for table in re.findall(rf"\bINSERT\s+INTO\s+{_TABLE}", text):
        found[table].add("INSERT")
        conflict = re.search(r"\bON\s+CONFLICT\s+ON\s+CONSTRAINT\s+(\w+)", text)
        if conflict:  # the arbiter constraint's columns are read
            found[table] |= {f"SELECT:{c}" for c in _constraint_columns(table, conflict[1])}
        returning = re.search(r"\bRETURNING\s+([\w\s,.\"*]+)", text)  # to the CTE's ")"
        if returning:
            for column in returning.group(1).split(","):
                name = column.strip().split(".")[-1].strip('"')
                found[table].add("SELECT" if name == "*" else f"SELECT:{name}")
    for table in re.findall(rf"(?<!FOR\s)(?<!DO\s)\bUPDATE\s+{_TABLE}", text):
        found[table] |= {"UPDATE", "SELECT"}
    for table in re.findall(rf"\bDELETE\s+FROM\s+{_TABLE}", text):
        found[table] |= {"DELETE", "SELECT"}
    for table in re.findall(rf"\b(?:FROM|JOIN|USING)\s+{_TABLE}", text):
        found[table].add("SELECT")
    if re.search(r"\bFOR\s+UPDATE\b", text):
        for table in re.findall(rf"\bFROM\s+{_TABLE}", text):
            found[table].add("UPDATE")
    return dict(found)


def _constraint_columns(table: str, constraint: str) -> list[str]:
    for candidate in metadata.tables[table].constraints:
        if candidate.name == constraint and isinstance(candidate, ColumnCollectionConstraint):
            return [column.name for column in candidate.columns]
    raise KeyError(f"{table} has no constraint {constraint!r}")


def _insert_privileges(table: sa.Table, provided: Iterable[str]) -> set[str]:
    """INSERT, and SELECT on the server-generated columns an ORM insert reads back."""
    given = set(provided)
    generated = [
        column.name
        for column in table.columns
        if (
            column.server_default is not None
            or column.identity is not None
            or column.computed is not None
        )
        and column.name not in given
    ]
    return {"INSERT", *(f"SELECT:{name}" for name in generated)}


def component_privileges(component: Component) -> Privileges:
    """The union of the privileges of everything ``component`` runs."""
    merged: Privileges = defaultdict(set)
    for name in component.statements:
        for table, privileges in privileges_of(query(name).text).items():
            merged[table] |= privileges
    for table, provided in component.inserts.items():
        merged[table] |= _insert_privileges(metadata.tables[table], provided)
    for table, columns in component.trigger_reads.items():
        merged[table] |= {f"SELECT:{column}" for column in columns}
    for table, columns in component.column_reads.items():
        merged[table].discard("SELECT")
        merged[table] |= {f"SELECT:{column}" for column in columns}
    return dict(merged)


def grant_statements(roles: Mapping[str, str], *, schema: str = "public") -> str:
    """``GRANT`` statements giving each role (component name -> role name) what it needs.

    Tables are qualified with ``schema``; with a schema other than ``public`` each role also
    gets it first on its ``search_path`` (oncely's statements use unqualified names).

    Raises:
        ConfigurationError: an unknown component, or a role or schema name that is not a
            plain identifier.
    """
    dialect: sa.Dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    quote = dialect.identifier_preparer.quote  # quotes reserved words only
    schema_sql = quote(validate_schema_name(schema))
    lines = [
        "-- Least-privilege roles for oncely (generated by `oncely db sql --roles`), derived from",
        "-- the statements each component runs. Run as the owner of oncely's tables, after",
        "-- `oncely db upgrade`, and again after an upgrade that adds a table.",
        "-- The NOTIFY triggers need no grant; oncely_outbox_seq_seq fills the outbox's seq.",
    ]
    for component_name, role in roles.items():
        component = COMPONENTS.get(component_name)
        if component is None:
            raise ConfigurationError(
                f"no oncely component {component_name!r} (known: {', '.join(COMPONENTS)})"
            )
        role_sql = quote(validate_role_name(role))
        lines += [
            "",
            f"-- {component.name}: {component.purpose}",
            f"-- CREATE ROLE {role_sql} LOGIN PASSWORD '...';",
            f"GRANT USAGE ON SCHEMA {schema_sql} TO {role_sql};",
        ]
        for table, privileges in sorted(component_privileges(component).items()):
            target = f"{schema_sql}.{quote(table)}"
            whole = sorted(p for p in privileges if ":" not in p)
            columns = sorted(p.split(":", 1)[1] for p in privileges if p.startswith("SELECT:"))
            if whole:
                lines.append(f"GRANT {', '.join(_ordered(whole))} ON {target} TO {role_sql};")
            if columns and "SELECT" not in whole:
                listed = ", ".join(quote(c) for c in columns)
                lines.append(f"GRANT SELECT ({listed}) ON {target} TO {role_sql};")
        for sequence in component.sequences:
            lines.append(f"GRANT USAGE ON SEQUENCE {schema_sql}.{quote(sequence)} TO {role_sql};")
        if schema != "public":
            lines.append(f"ALTER ROLE {role_sql} SET search_path = {schema_sql}, public;")
        if component.name == "consumer":
            lines += [
                "-- Your effects' own tables: grant what the handlers write (ctx.insert,",
                "-- ctx.upsert, ctx.session), e.g.",
                f"--   GRANT SELECT, INSERT, UPDATE ON {schema_sql}.my_table TO {role_sql};",
            ]
    return "\n".join(lines) + "\n"


def _ordered(privileges: list[str]) -> list[str]:
    order = ["SELECT", "INSERT", "UPDATE", "DELETE"]
    return sorted(privileges, key=order.index)
