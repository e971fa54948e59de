-- oncely 0010: each relay's output mode, for `oncely status`.
-- Runs inside one transaction with search_path set to the target schema.
--
-- A relay writes whether it runs in exactly-once mode (ONCELY_RELAY_EXACTLY_ONCE) with each
-- heartbeat, next to its id. Relays of earlier versions never write it: they run at least once,
-- the column's default.
ALTER TABLE oncely_relay_members ADD COLUMN exactly_once boolean NOT NULL DEFAULT false;
