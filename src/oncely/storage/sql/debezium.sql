-- Debezium mode: the replication-slot statements oncely runs when Debezium's Outbox Event
-- Router relays the outbox instead of oncely's relay (the purge is in outbox.sql). Each starts
-- with "-- name: <name>".

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
