-- Debezium mode: the statements oncely runs when Debezium's Outbox Event Router relays the
-- outbox instead of oncely's relay. Each starts with "-- name: <name>".

-- name: debezium_purge
-- Delete one batch of outbox rows created before the retention horizon, whatever their status:
-- in Debezium mode nothing settles a row (it stays 'pending'), and Debezium reads the INSERT
-- from the WAL, not from the table, so deleting a row never loses its event. The connector
-- skips DELETEs (skipped.operations), so the purge publishes nothing.
DELETE FROM oncely_outbox
WHERE id IN (
    SELECT id FROM oncely_outbox
    WHERE created_at < now() - make_interval(secs => :older_than)
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
