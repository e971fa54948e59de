-- Drops every table and trigger function that any oncely migration creates, whatever version
-- the database is at, and oncely_migrations: what oncely.alembic's downgrade_oncely() runs.
-- Runs inside one transaction with search_path set to oncely's schema. Indexes, constraints and
-- triggers go with their tables. No CASCADE: an object of yours that depends on one of these
-- tables (a view, a foreign key) stops the drop instead of being dropped with it.
-- A new migration that creates a table or a function adds it here (a unit test checks).

DROP TABLE IF EXISTS
    oncely_outbox,
    oncely_relay_shards,
    oncely_relay_members,
    oncely_relay_parked,
    oncely_relay_held,
    oncely_relay_kept,
    oncely_receipts,
    oncely_tasks,
    oncely_idempotency_keys,
    -- `oncely db upgrade --partition-every`: the layout of the partitioned tables.
    oncely_partitioning,
    oncely_outbox_keys,
    -- 0008: retention's marks of Kafka's high watermarks.
    oncely_retention_marks,
    -- 0011: the operators' audit log.
    oncely_audit,
    -- 0012: skipped outbox rows, records dead-lettered by a consumer.
    oncely_relay_skipped,
    oncely_dead_lettered;

DROP FUNCTION IF EXISTS oncely_outbox_wake();
DROP FUNCTION IF EXISTS oncely_tasks_notify();
DROP FUNCTION IF EXISTS oncely_outbox_key_guard();
DROP FUNCTION IF EXISTS oncely_outbox_keys_forget();
DROP FUNCTION IF EXISTS oncely_relay_kept_forget();
DROP FUNCTION IF EXISTS oncely_passed(xid8, bigint, pg_snapshot, pg_snapshot, bigint);
-- 0001's wake-up of every relay; 0003 replaced it with oncely_outbox_wake.
DROP FUNCTION IF EXISTS oncely_outbox_notify();

DROP TABLE IF EXISTS oncely_migrations;
