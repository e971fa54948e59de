-- Debezium mode: the statements oncely runs when Debezium's Outbox Event Router relays the
-- outbox instead of oncely's relay. Each starts with "-- name: <name>".

-- name: debezium_purge_slots
-- The logical replication slots of this database: the candidates for the connector's slot, with
-- whether each has confirmed (confirmed_flush_lsn) the WAL position :lsn (NULL: not asked).
-- PostgreSQL records no link from a slot to a publication, so the database is the scope.
SELECT slot_name, plugin, active,
       CAST(confirmed_flush_lsn AS text) AS confirmed_flush_lsn,
       COALESCE(confirmed_flush_lsn >= CAST(:lsn AS pg_lsn), false) AS passed,
       GREATEST(COALESCE(pg_wal_lsn_diff(CAST(:lsn AS pg_lsn), confirmed_flush_lsn), 0), 0)::bigint
           AS behind_bytes
FROM pg_replication_slots
WHERE slot_type = 'logical' AND database = current_database()
ORDER BY slot_name

-- name: debezium_purge_mark
-- A purge mark: the xmin of this statement's snapshot (every transaction id below it had
-- finished when the snapshot was taken) and the WAL insert position read after it. The snapshot
-- is taken before the target list is evaluated, so every transaction older than xmin wrote its
-- commit record before lsn. The insert position, not pg_current_wal_lsn() (the write position),
-- because with synchronous_commit = off a commit may be visible before its record is written.
SELECT CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS xmin,
       CAST(pg_current_wal_insert_lsn() AS text) AS lsn

-- name: debezium_purge_preview
-- Per topic: the outbox rows a purge would delete, and its oldest row. A row qualifies when it
-- was created before the horizon and its row version was written by a transaction older than
-- the mark's xmin (age() compares 32-bit xids modulo 2^31, as PostgreSQL does; a row written
-- by a transaction that was still running at the mark, or after it, does not qualify).
SELECT topic, count(*) AS rows,
       (array_agg(id ORDER BY created_at, seq))[1] AS oldest_id,
       min(created_at) AS oldest_created_at
FROM oncely_outbox
WHERE created_at < now() - make_interval(secs => :older_than)
  AND age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))
GROUP BY topic
ORDER BY topic

-- name: debezium_purge_waiting
-- How many rows older than the horizon the mark does not cover (written by transactions still
-- running at the mark, or later): the purge keeps them.
SELECT count(*) FROM oncely_outbox
WHERE created_at < now() - make_interval(secs => :older_than)
  AND NOT age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))

-- name: debezium_purge
-- Delete one batch of the rows debezium_purge_preview counts: created before the horizon and
-- written by a transaction older than the mark's xmin. The caller deletes only after the
-- connector's slot confirmed the mark's WAL position, so the connector has read every such row
-- (streamed from the WAL, or in the snapshot it took when it started). In Debezium mode nothing
-- settles a row, so the status does not matter. The connector skips DELETEs
-- (skipped.operations), so the purge publishes nothing.
DELETE FROM oncely_outbox
WHERE id IN (
    SELECT id FROM oncely_outbox
    WHERE created_at < now() - make_interval(secs => :older_than)
      AND age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))
    LIMIT :batch_size
)

-- name: debezium_slot_status
-- The connector's replication slot: whether a walsender holds it, and how much WAL it keeps.
SELECT slot_name, plugin, database, active,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained_wal_bytes
FROM pg_replication_slots
WHERE slot_name = :slot_name

-- name: debezium_drop_slot
-- Drop the replication slot if no walsender holds it (an idle slot retains WAL forever).
SELECT pg_drop_replication_slot(slot_name)
FROM pg_replication_slots
WHERE slot_name = :slot_name AND NOT active
