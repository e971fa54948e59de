"""The time-partitioned layout of the outbox and the receipts: converting the tables, reading
their partitions, creating partitions ahead and dropping one.

Both tables are range-partitioned by their event id (``oncely_outbox.id``,
``oncely_receipts.event_id``). Event ids are UUIDv7, whose first 48 bits are Unix milliseconds,
so the lowest id of a millisecond (:func:`oncely.ids.lowest_of`) bounds a time range, and a
partition holds the events created in one *step* (an interval fixed at conversion, aligned to
the Unix epoch: ``1d`` partitions start at midnight UTC). The primary keys include the partition
key, so ``oncely_outbox.id`` and the receipts' ``(event_id, effect)`` stay unique over the whole
table.
A ``_default`` partition takes the rows no range holds (ids of another UUID version, a clock far
off, no partition created ahead yet): staging and consuming never fail for want of a partition.

The outbox's ``event_key`` (the idempotency key) cannot be a constraint of the partitioned
table, as it does not include the id. So the keys of the rows the outbox holds are also kept in
one unpartitioned table, ``oncely_outbox_keys`` (``event_key`` primary key, ``event_id``): a
``BEFORE INSERT`` trigger on the outbox inserts each new row's key there, and refuses a key that
is there already, raising PostgreSQL's unique violation under the constraint name
``oncely_outbox_event_key_key`` (so :class:`~oncely.storage.errors.DuplicateEventError` is
raised as before); an ``AFTER DELETE`` trigger removes the keys of deleted rows (the relay's
and Debezium mode's purges), and :func:`drop` those of a dropped partition. So a key stays
unique among every row the outbox retains, at any isolation level (a transaction staging a key
another one has staged but not committed waits for it, as with a unique constraint), at the
cost of one index insert per keyed row, whatever the number of partitions (the partitions have
no index of their own on ``event_key``). A row whose key is
its own id (``stage()`` without an idempotency key, most rows) skips the trigger: the primary
key already makes its id unique, and no earlier row can hold a key equal to a new id; a later
row given such a key is checked against the outbox's primary key (one partition's index). (A
trigger that looked the key up in every partition costs a probe of each partition's index per
staged row: about 5 ms a row with 120 partitions.) The key of a row retention kept aside when
it dropped the row's partition (``oncely_relay_kept``) stays until the copy is deleted.

Which partition may be dropped is decided by ``oncely.retention``; this module only runs the
DDL. Every identifier written into DDL comes from the catalog or from :func:`partition_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from uuid import UUID

import sqlalchemy as sa

from oncely.durations import describe, parse_duration
from oncely.errors import ConfigurationError, OncelyError
from oncely.ids import lowest_of, moment_of

#: The partitioned tables, with their partition key column.
PARTITION_KEYS = {"oncely_outbox": "id", "oncely_receipts": "event_id"}
#: Where the layout is recorded: one row per partitioned table.
LAYOUT_TABLE = "oncely_partitioning"
#: The shortest step: partitions of one minute (benchmarks and tests use short steps).
MIN_STEP = timedelta(minutes=1)
#: The partitioned outbox's idempotency keys (``event_key`` -> ``event_id``): the unique index
#: over every partition that a partitioned table cannot have.
KEYS_TABLE = "oncely_outbox_keys"
#: The rows of parked keys kept aside when their outbox partition is dropped (migration 0009).
KEPT_TABLE = "oncely_relay_kept"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: A UUID as PostgreSQL prints it (a key that could be another row's own id).
_UUID_TEXT = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_BOUND = re.compile(r"FOR VALUES FROM \('([0-9a-f-]{36})'\) TO \('([0-9a-f-]{36})'\)")


class PartitionError(OncelyError):
    """A partition could not be created or dropped now (the message says why)."""


def parse_step(text: str) -> timedelta:
    """``"1d"``, ``"6h"``, ``"15m"`` (:mod:`oncely.durations`' grammar) as a step; raise
    ConfigurationError for anything else."""
    try:
        step: timedelta | None = parse_duration(text)
    except ValueError:
        step = None
    return validate_step(step, shown=repr(text))


def validate_step(step: timedelta | None, *, shown: str | None = None) -> timedelta:
    """``step`` if it is a partition step: whole minutes, at least :data:`MIN_STEP`, that divide
    a day or are whole days (what :func:`parse_step` accepts); else raise ConfigurationError
    (``shown``: how the caller wrote it)."""
    day = timedelta(days=1)
    if (
        step is None
        or step < MIN_STEP
        or step % MIN_STEP
        or (day % step if step < day else step % day)
    ):
        raise ConfigurationError(
            f"partition step {shown or str(step)}: give minutes, hours or days that divide a "
            "day or are whole days, e.g. 1d, 6h or 15m (at least 1m)"
        )
    return step


def window_start(moment: datetime, step: timedelta) -> datetime:
    """The start of the step ``moment`` falls in (steps are aligned to the Unix epoch)."""
    return _EPOCH + ((moment - _EPOCH) // step) * step


def partition_name(table: str, lower: datetime) -> str:
    """``oncely_outbox_p20261206t000000``: the table and the partition's start, UTC."""
    return f"{table}_p{lower.astimezone(UTC):%Y%m%dt%H%M%S}"


@dataclass(frozen=True)
class Partition:
    """One partition: its table, name, time range (``None`` for the default partition) and
    size on disk (table, indexes and TOAST)."""

    table: str
    name: str
    lower: datetime | None
    upper: datetime | None
    bytes: int

    @property
    def is_default(self) -> bool:
        return self.lower is None

    def ids(self) -> tuple[UUID, UUID]:
        """The partition's id range ``[low, high)``; raises ValueError for the default one."""
        if self.lower is None or self.upper is None:
            raise ValueError(f"{self.name} is the default partition: it has no range")
        return lowest_of(self.lower), lowest_of(self.upper)


def step_of(conn: sa.Connection) -> timedelta | None:
    """The partition step of this database's tables, ``None`` if they are not partitioned."""
    if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": LAYOUT_TABLE}).scalar() is None:
        return None
    seconds = conn.execute(sa.text(f"SELECT min(step_seconds) FROM {LAYOUT_TABLE}")).scalar()
    return None if seconds is None else timedelta(seconds=int(seconds))


def partitions(conn: sa.Connection, table: str) -> list[Partition]:
    """``table``'s partitions, oldest first, the default partition last."""
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound,"
            " pg_total_relation_size(c.oid) AS bytes"
            " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = to_regclass(:table)"
        ),
        {"table": table},
    ).all()
    found = []
    for row in rows:
        match = _BOUND.fullmatch(row.bound)
        lower = moment_of(UUID(match.group(1))) if match else None
        upper = moment_of(UUID(match.group(2))) if match else None
        found.append(Partition(table, row.relname, lower, upper, int(row.bytes)))
    return sorted(found, key=lambda p: (p.lower is None, p.lower or _EPOCH))


def convert(conn: sa.Connection, *, step: timedelta, ahead: int, now: datetime) -> list[str]:
    """Convert the outbox and the receipts into partitioned tables of ``step``, in ``conn``'s
    transaction (``search_path`` names oncely's schema; the caller commits); return the tables
    converted (none if both already are).

    Every row is copied into the new table (the pause: both tables are locked for writes until
    the transaction commits), with its ``seq`` and ``txid`` (the relay's progress stays valid);
    partitions cover the steps that hold rows and ``ahead`` steps from ``now``. Grants on the
    old tables are carried over, and so is their membership of publications, which are set to
    ``publish_via_partition_root`` (Debezium mode keeps receiving ``oncely_outbox`` rows).

    Raises :class:`~oncely.errors.ConfigurationError` when ``step`` is not a partition step
    (:func:`validate_step`) or the tables are already partitioned by another step.
    """
    validate_step(step)
    current = step_of(conn)
    if current is not None and current != step:
        raise ConfigurationError(
            f"--partition-every {describe(step)}: the tables are partitioned by "
            f"{describe(current)} already; the step cannot change (drop --partition-every)"
        )
    conn.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {LAYOUT_TABLE} ("
        " table_name text PRIMARY KEY,"
        " step_seconds bigint NOT NULL,"
        " converted_at timestamptz NOT NULL DEFAULT now())"
    )
    converted = []
    for table in PARTITION_KEYS:
        if conn.execute(
            sa.text("SELECT 1 FROM " + LAYOUT_TABLE + " WHERE table_name = :t"), {"t": table}
        ).first():
            continue
        _convert_table(conn, table, step, ahead=ahead, now=now)
        conn.execute(
            sa.text(f"INSERT INTO {LAYOUT_TABLE} (table_name, step_seconds) VALUES (:t, :s)"),
            {"t": table, "s": int(step.total_seconds())},
        )
        converted.append(table)
    return converted


def _convert_table(
    conn: sa.Connection, table: str, step: timedelta, *, ahead: int, now: datetime
) -> None:
    key = PARTITION_KEYS[table]
    old = f"{table}_unpartitioned"
    run = conn.exec_driver_sql
    run(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    run(f"ALTER TABLE {table} RENAME TO {old}")
    indexes = conn.execute(
        sa.text("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = to_regclass(:t)"),
        {"t": old},
    ).scalars()
    for index in list(indexes):
        bare = index.rsplit(".", 1)[-1]
        run(f"ALTER INDEX {index} RENAME TO {bare.replace(table, old, 1)}")
    if table == "oncely_outbox":
        run(f"DROP TRIGGER oncely_outbox_wake ON {old}")
        run(f"ALTER SEQUENCE oncely_outbox_seq_seq RENAME TO {old}_seq_seq")
        run(
            f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS INCLUDING GENERATED)"
            " PARTITION BY RANGE (id)"
        )
        run("CREATE SEQUENCE oncely_outbox_seq_seq OWNED BY oncely_outbox.seq")
        run(
            "ALTER TABLE oncely_outbox ALTER COLUMN seq"
            " SET DEFAULT nextval('oncely_outbox_seq_seq')"
        )
        # The next seq is the old sequence's next value (or past the highest row), exactly:
        # a fresh outbox's first row still gets seq 1 (republish reads a first seq above 1 as
        # purged rows).
        run(
            "SELECT setval('oncely_outbox_seq_seq', GREATEST("
            f"(SELECT last_value + is_called::int FROM {old}_seq_seq),"
            f" (SELECT max(seq) + 1 FROM {old}), 1), false)"
        )
        run("ALTER TABLE oncely_outbox ADD CONSTRAINT oncely_outbox_pkey PRIMARY KEY (id)")
        run("CREATE INDEX oncely_outbox_shard_txid_idx ON oncely_outbox (shard, txid)")
        run(
            "CREATE TRIGGER oncely_outbox_wake AFTER INSERT ON oncely_outbox"
            " FOR EACH STATEMENT EXECUTE FUNCTION oncely_outbox_wake()"
        )
        _create_key_guard(conn)
    else:
        run(f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS) PARTITION BY RANGE (event_id)")
        run(
            "ALTER TABLE oncely_receipts ADD CONSTRAINT oncely_receipts_pkey"
            " PRIMARY KEY (event_id, effect)"
        )
        run(
            "CREATE INDEX oncely_receipts_effect_applied_at_idx"
            " ON oncely_receipts (effect, applied_at)"
        )
    _copy_grants(conn, old, table)
    _copy_publications(conn, old, table)
    create_partition(conn, table, None, None)
    windows = conn.execute(
        sa.text(
            f"SELECT DISTINCT ((('x' || substr(replace({key}::text, '-', ''), 1, 12))::bit(48)"
            f"::bigint) / :step_ms) AS n FROM {old} WHERE substr({key}::text, 15, 1) = '7'"
        ),
        {"step_ms": int(step / timedelta(milliseconds=1))},
    ).scalars()
    starts = {_EPOCH + step * int(n) for n in windows}
    first = window_start(now, step)
    starts |= {first + step * n for n in range(ahead + 1)}
    for start in sorted(starts):
        create_partition(conn, table, start, start + step)
    columns = _columns(conn, table)
    run(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {old}")
    run(f"DROP TABLE {old}")


def _columns(conn: sa.Connection, table: str) -> str:
    """``table``'s stored columns, quoted, in order (the generated ones are computed again)."""
    return ", ".join(
        f'"{name}"'
        for name in conn.execute(
            sa.text(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:t)"
                " AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
            ),
            {"t": table},
        ).scalars()
    )


def _copy_grants(conn: sa.Connection, old: str, new: str) -> None:
    """Give every role what it was granted on ``old`` (whole table and per column) on ``new``;
    a role that may insert into the outbox also gets its ``seq`` sequence and SELECT on its
    ``event_key`` (the key guard's trigger reads it with the inserting role's privileges)."""
    granted = conn.execute(
        sa.text(
            "SELECT a.privilege_type, a.grantee::regrole::text, NULL AS col"
            " FROM pg_class c, aclexplode(c.relacl) a"
            " WHERE c.oid = to_regclass(:old) AND a.grantee NOT IN (0, c.relowner)"
            " UNION ALL"
            " SELECT a.privilege_type, a.grantee::regrole::text, quote_ident(t.attname)"
            " FROM pg_attribute t, aclexplode(t.attacl) a"
            " WHERE t.attrelid = to_regclass(:old) AND a.grantee <> 0"
        ),
        {"old": old},
    ).all()
    for privilege, grantee, column in granted:
        columns = f" ({column})" if column else ""
        conn.exec_driver_sql(f"GRANT {privilege}{columns} ON {new} TO {grantee}")
        if new == "oncely_outbox" and privilege == "INSERT":
            conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE oncely_outbox_seq_seq TO {grantee}")
            conn.exec_driver_sql(f"GRANT SELECT (event_key) ON oncely_outbox TO {grantee}")


def _copy_publications(conn: sa.Connection, old: str, new: str) -> None:
    """Put ``new`` in every publication that names ``old`` (dropping ``old`` would take it out),
    and make every publication that publishes ``old`` publish ``new`` via its root: a logical
    replication client (Debezium) then receives ``new``'s rows under ``new``'s name, not under
    its partitions' names. Needs ownership of those publications (a database error otherwise:
    nothing is converted, rather than a stream that silently stops)."""
    quote = conn.dialect.identifier_preparer.quote_identifier
    named = (
        conn.execute(
            sa.text(
                "SELECT p.pubname FROM pg_publication_rel r"
                " JOIN pg_publication p ON p.oid = r.prpubid"
                " WHERE r.prrelid = to_regclass(:t) ORDER BY 1"
            ),
            {"t": old},
        )
        .scalars()
        .all()
    )
    publishing = (
        conn.execute(
            sa.text(
                "SELECT DISTINCT t.pubname FROM pg_publication_tables t"
                " JOIN pg_publication p ON p.pubname = t.pubname"
                " JOIN pg_class c ON c.oid = to_regclass(:t)"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE t.schemaname = n.nspname AND t.tablename = c.relname AND NOT p.pubviaroot"
                " ORDER BY 1"
            ),
            {"t": old},
        )
        .scalars()
        .all()
    )
    for name in named:
        conn.exec_driver_sql(f"ALTER PUBLICATION {quote(name)} ADD TABLE {new}")
    for name in sorted(set(named) | set(publishing)):
        conn.exec_driver_sql(
            f"ALTER PUBLICATION {quote(name)} SET (publish_via_partition_root = true)"
        )


def _create_key_guard(conn: sa.Connection) -> None:
    """The outbox's ``event_key`` uniqueness across partitions (see the module's docstring):
    the :data:`KEYS_TABLE` index, filled by a ``BEFORE INSERT`` row trigger and emptied by an
    ``AFTER DELETE`` statement trigger. Both functions are ``SECURITY DEFINER`` (the roles
    that stage and purge need no grant on the keys table) and name the tables by schema."""
    schema = conn.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    keys = f"{schema}.{KEYS_TABLE}"
    run = conn.exec_driver_sql
    run(f"CREATE TABLE {KEYS_TABLE} (event_key text PRIMARY KEY, event_id uuid NOT NULL)")
    run(f"CREATE INDEX {KEYS_TABLE}_event_id_idx ON {KEYS_TABLE} (event_id)")
    conn.execute(
        sa.text(
            "CREATE OR REPLACE FUNCTION oncely_outbox_key_guard() RETURNS trigger LANGUAGE plpgsql"
            " SECURITY DEFINER SET search_path = pg_catalog, pg_temp"
            " AS $body$ BEGIN"
            f" INSERT INTO {keys} (event_key, event_id) VALUES (NEW.event_key, NEW.id)"
            " ON CONFLICT (event_key) DO NOTHING;"
            f" IF NOT FOUND OR (NEW.event_key ~ '{_UUID_TEXT}'"
            f" AND EXISTS (SELECT 1 FROM {schema}.oncely_outbox"
            " WHERE id = NEW.event_key::uuid AND event_key = NEW.event_key)) THEN"
            " RAISE unique_violation USING"
            " MESSAGE = 'duplicate key value violates unique constraint"
            ' "oncely_outbox_event_key_key"\','
            " DETAIL = format('Key (event_key)=(%s) already exists.', NEW.event_key),"
            " CONSTRAINT = 'oncely_outbox_event_key_key', TABLE = 'oncely_outbox',"
            f" SCHEMA = {_literal(schema)};"
            " END IF; RETURN NEW; END $body$"
        )
    )
    conn.execute(
        sa.text(
            "CREATE OR REPLACE FUNCTION oncely_outbox_keys_forget() RETURNS trigger"
            " LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp"
            f" AS $body$ BEGIN DELETE FROM {keys} AS k USING gone AS g"
            " WHERE k.event_key = g.event_key AND k.event_id = g.id; RETURN NULL; END $body$"
        )
    )
    run(
        "CREATE TRIGGER oncely_outbox_key_guard BEFORE INSERT ON oncely_outbox"
        " FOR EACH ROW WHEN (NEW.event_key <> NEW.id::text)"
        " EXECUTE FUNCTION oncely_outbox_key_guard()"
    )
    run(
        "CREATE TRIGGER oncely_outbox_keys_forget AFTER DELETE ON oncely_outbox"
        " REFERENCING OLD TABLE AS gone FOR EACH STATEMENT"
        " EXECUTE FUNCTION oncely_outbox_keys_forget()"
    )


def _literal(text: str) -> str:
    return "'" + text.strip('"').replace("'", "''") + "'"


def create_partition(
    conn: sa.Connection, table: str, lower: datetime | None, upper: datetime | None
) -> str:
    """Create ``table``'s partition for ``[lower, upper)`` (both ``None``: the default one) if
    missing, in ``conn``'s transaction; return its name.

    The rows of that range in the default partition (staged before the partition existed: a
    client clock ahead, a run that came late) are moved into it in the same transaction, every
    column as it was (``seq`` and ``txid``: the relay's progress still passes them, or not, as
    before), their idempotency keys kept. The partition is built as a table of its own, filled
    and attached (``ATTACH PARTITION``): the moved rows enter no trigger of the outbox (its key
    guard, its wake-up) and no publication (a connector is not sent them again; the DELETE
    from the default partition is not published either, Debezium's publication publishing
    inserts only), and the outbox itself is locked in SHARE UPDATE EXCLUSIVE mode only, so
    staging into its other partitions goes on. The default partition is locked (ACCESS
    EXCLUSIVE) from before the move to the commit: no row of the range can enter it meanwhile;
    staging of rows it takes, and readers of the outbox, wait that long (PostgreSQL checks
    the default partition for rows of the new range while attaching, one scan of it).

    Raises a database error (the caller rolls back) when a lock is not granted within the
    transaction's ``lock_timeout``, or a relation other than this partition has its name.
    """
    run = conn.exec_driver_sql
    default = f"{table}_default"
    if lower is None or upper is None:
        if conn.execute(sa.text("SELECT to_regclass(:n)"), {"n": default}).scalar() is None:
            run(f"CREATE TABLE {default} PARTITION OF {table} DEFAULT")
        return default
    name = partition_name(table, lower)
    if name in {p.name for p in partitions(conn, table)}:
        return name
    low, high = lowest_of(lower), lowest_of(upper)
    key = PARTITION_KEYS[table]
    # ATTACH's own locks, in its order (the table, then the default partition), taken first.
    run(f"LOCK TABLE ONLY {table} IN SHARE UPDATE EXCLUSIVE MODE")
    run(f"LOCK TABLE {default} IN ACCESS EXCLUSIVE MODE")
    run(f"CREATE TABLE {name} (LIKE {table} INCLUDING ALL)")
    columns = _columns(conn, table)
    conn.execute(
        sa.text(
            f"WITH moved AS (DELETE FROM {default} WHERE {_WITHIN.format(key=key)}"
            f" RETURNING *) INSERT INTO {name} ({columns}) SELECT {columns} FROM moved"
        ),
        {"low": str(low), "high": str(high)},
    )
    run(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ('{low}') TO ('{high}')")
    return name


def create_ahead(
    conn: sa.Connection, table: str, step: timedelta, *, until: datetime, now: datetime
) -> list[str]:
    """Create ``table``'s missing partitions from the step of ``now`` to the one holding
    ``until``, in ``conn``'s transaction; return the names created."""
    existing = {p.name for p in partitions(conn, table)}
    created = []
    start = window_start(now, step)
    while start <= until:
        if partition_name(table, start) not in existing:
            created.append(create_partition(conn, table, start, start + step))
        start += step
    return created


def freeze(conn: sa.Connection, partition: Partition, *, timeout: float) -> None:
    """Stop every write into ``partition`` for the rest of ``conn``'s transaction, waiting at
    most ``timeout`` seconds, so that its facts, checked next, stay true until :func:`drop`.
    Call it first in the transaction, which must run at READ COMMITTED: nothing is read
    before the lock is granted, so the check sees every transaction that committed during
    the wait.

    An outbox partition is frozen by its table's ACCESS EXCLUSIVE lock, taken while the
    transaction holds no other lock: a transaction that writes into the table (an insert
    with an old id into the partition, a key of one of its rows staged again) finishes before
    the freeze or waits behind it, and cannot deadlock with the drop. Staging waits for the
    check and the drop (index probes and the partition's keys). A receipts partition is
    frozen by a SHARE lock on the partition alone (reads go on, and so do consumers writing
    current receipts), as its check scans the partition; a consumer batch that writes a late
    receipt into it while holding the table can then be chosen as a deadlock victim: its
    transaction rolls back and the consumer retries it.

    Raises :class:`PartitionError` when the lock is not granted in time (a transaction is
    writing into it): nothing is dropped, a later run tries again.
    """
    name = _checked(partition)
    if partition.table == "oncely_outbox":
        _lock(conn, f"ONLY {partition.table}", "ACCESS EXCLUSIVE", timeout)
    else:
        _lock(conn, name, "SHARE", timeout)


def drop(conn: sa.Connection, partition: Partition, *, timeout: float) -> None:
    """Drop ``partition`` (frozen by :func:`freeze` and checked by the caller) in ``conn``'s
    transaction.

    ``DROP TABLE`` of a partition takes ACCESS EXCLUSIVE on its table: every query on the table
    waits behind it, at most ``timeout`` seconds (then :class:`PartitionError`, nothing
    dropped). The outbox's table is already held by the freeze; the receipts partition's SHARE
    lock lets readers through meanwhile, so a transaction that holds the table and reads the
    partition finishes instead of deadlocking with the drop.
    """
    name = _checked(partition)
    if partition.is_default:
        raise ValueError(f"{name}: only a range partition oncely created is dropped")
    if partition.table == "oncely_outbox":  # its keyed rows' keys go with it (no DELETE runs),
        conn.execute(  # but those of its rows kept aside (the kept copy's trigger frees them)
            sa.text(
                f"DELETE FROM {KEYS_TABLE} AS k WHERE {_WITHIN.format(key='k.event_id')}"
                f" AND NOT EXISTS (SELECT 1 FROM {KEPT_TABLE} AS c WHERE c.id = k.event_id)"
            ),
            _range(partition),
        )
    _lock(conn, f"ONLY {partition.table}", "ACCESS EXCLUSIVE", timeout)
    conn.exec_driver_sql(f"DROP TABLE {name}")


def _lock(conn: sa.Connection, target: str, mode: str, timeout: float) -> None:
    # SET LOCAL and LOCK are utility statements: neither takes a snapshot.
    conn.exec_driver_sql(f"SET LOCAL lock_timeout = {max(round(timeout * 1000), 1)}")
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(f"LOCK TABLE {target} IN {mode} MODE")
    except sa.exc.OperationalError as exc:
        raise PartitionError(
            f"{target.removeprefix('ONLY ')}: lock not granted in {timeout:g} s (a transaction "
            f"is using it: {type(exc.orig).__name__}); retried next run"
        ) from exc


def _checked(partition: Partition) -> str:
    """``partition``'s name, if it is one oncely creates (identifiers in DDL come from here)."""
    if partition.table not in PARTITION_KEYS or partition.name not in (
        f"{partition.table}_default",
        *([partition_name(partition.table, partition.lower)] if partition.lower else []),
    ):
        raise ValueError(f"{partition.name}: not a partition oncely created")
    return partition.name


def _range(partition: Partition) -> dict[str, str]:
    low, high = partition.ids()
    return {"low": str(low), "high": str(high)}


#: A partition's rows, read through the partitioned table (pruned to the partition): a role
#: with SELECT on the table plans retention without owning the partitions.
_WITHIN = "{key} >= CAST(:low AS uuid) AND {key} < CAST(:high AS uuid)"


def unpassed_shards(conn: sa.Connection, partition: Partition) -> list[int]:
    """The shards whose progress has not passed every row of the outbox ``partition``: the
    partition's highest ``txid`` of the shard is not below the ``xmin`` of the shard's done
    snapshot (one index probe per shard; conservative, as the relay's own purge)."""
    within = _WITHIN.format(key="o.id")
    return list(
        conn.execute(
            sa.text(
                "SELECT s.shard FROM oncely_relay_shards AS s CROSS JOIN LATERAL"
                " (SELECT max(o.txid) AS txid FROM oncely_outbox AS o"
                f"  WHERE o.shard = s.shard AND {within}) AS m"
                " WHERE m.txid IS NOT NULL AND m.txid >= pg_snapshot_xmin(s.done)"
                " ORDER BY s.shard"
            ),
            _range(partition),
        ).scalars()
    )


def outbox_holds(conn: sa.Connection, partition: Partition) -> str | None:
    """The outbox partition that holds an event of the receipts ``partition``'s range, or
    ``None`` when none does: the outbox partition of the same range, or the default one once
    that was dropped (a row staged later; the default partition never holds rows of a range
    that has its partition, :func:`create_partition` moves them), so one row answers; else
    :data:`KEPT_TABLE` when only rows of parked keys kept aside from dropped partitions do (the
    relay still publishes them)."""
    within = _WITHIN.format(key="id")
    statement = sa.text(
        f"SELECT tableoid::regclass::text FROM oncely_outbox WHERE {within} LIMIT 1"
    )
    found: str | None = conn.execute(statement, _range(partition)).scalar()
    if (
        found is None
        and conn.execute(
            sa.text(f"SELECT 1 FROM {KEPT_TABLE} WHERE {within} LIMIT 1"), _range(partition)
        ).first()
    ):
        found = KEPT_TABLE
    return found


def purge_default(
    conn: sa.Connection, *, below: datetime, older_than: timedelta, limit: int
) -> int:
    """Delete at most ``limit`` rows of the outbox's default partition that no range partition
    will ever take, with their idempotency keys, in ``conn``'s transaction (one statement);
    return how many.

    A row goes when its id is below ``below``'s (partitions are only created from the current
    step on, so its range's partition was dropped or never made) or is not a UUIDv7 (its
    "time" is random), every snapshot after its shard's recorded progress sees it (the relay's
    ``txid < pg_snapshot_xmin(done)`` rule), no parked key holds its aggregate (as the relay's
    batched DELETE) and it is not held, and it was staged more than ``older_than`` ago (its
    ``created_at``, the database's clock: the republish horizon). Progress, parked and held rows
    are read in the statement's one snapshot. Deleting from the partition itself fires no
    trigger of the outbox, so the keys are deleted here.
    """
    deleted = conn.execute(
        sa.text(
            "WITH gone AS (DELETE FROM oncely_outbox_default WHERE id IN ("
            "  SELECT o.id FROM oncely_relay_shards AS s"
            "  JOIN oncely_outbox_default AS o"
            "    ON o.shard = s.shard AND o.txid < pg_snapshot_xmin(s.done)"
            "  WHERE (o.id < CAST(:below AS uuid) OR substr(o.id::text, 15, 1) <> '7')"
            "    AND o.created_at < now() - make_interval(secs => :older_than)"
            "    AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p"
            "                    WHERE p.topic = o.topic AND p.aggregateid = o.aggregateid)"
            "    AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)"
            "  LIMIT :limit)"
            " RETURNING id, event_key),"
            f" forgotten AS (DELETE FROM {KEYS_TABLE} AS k USING gone AS g"
            "  WHERE k.event_key = g.event_key AND k.event_id = g.id)"
            " SELECT count(*) FROM gone"
        ),
        {
            "below": str(lowest_of(below)),
            "older_than": older_than.total_seconds(),
            "limit": limit,
        },
    ).scalar_one()
    return int(deleted)


def has_receipts(conn: sa.Connection, partition: Partition) -> bool:
    """Whether the receipts ``partition`` holds a receipt (one probe of its primary key)."""
    within = _WITHIN.format(key="event_id")
    statement = sa.text(f"SELECT 1 FROM oncely_receipts WHERE {within} LIMIT 1")
    return conn.execute(statement, _range(partition)).first() is not None


@dataclass(frozen=True)
class Receipted:
    """Where a receipts partition's receipts were read from Kafka: (topic, partition) -> the
    highest offset receipted there, and how many receipts have no Kafka position (topic,
    partition or offset ``NULL``)."""

    highest: dict[tuple[str, int], int]
    unplaced: int


def receipted(conn: sa.Connection, partition: Partition) -> Receipted:
    """Where the receipts ``partition``'s receipts were read from Kafka (one scan of it)."""
    rows = conn.execute(
        sa.text(
            'SELECT topic, partition, max("offset"), count(*),'
            ' count(*) FILTER (WHERE "offset" IS NULL) FROM oncely_receipts'
            f" WHERE {_WITHIN.format(key='event_id')} GROUP BY topic, partition"
        ),
        _range(partition),
    ).all()
    highest: dict[tuple[str, int], int] = {}
    unplaced = 0
    for topic, number, offset, total, without in rows:
        if topic is None or number is None:
            unplaced += int(total)
            continue
        unplaced += int(without)
        if offset is not None:
            highest[(topic, int(number))] = int(offset)
    return Receipted(highest, unplaced)


def default_rows(conn: sa.Connection, table: str) -> int:
    """How many live rows ``table``'s default partition holds, from PostgreSQL's statistics
    (no scan, no privilege on the partition needed; counted from the first insert, no ANALYZE
    needed, a few seconds behind the writes that change it; 0 again after a statistics reset
    until the next write)."""
    count = conn.execute(
        sa.text("SELECT pg_stat_get_live_tuples(to_regclass(:name))"),
        {"name": f"{table}_default"},
    ).scalar()
    return max(int(count or 0), 0)
