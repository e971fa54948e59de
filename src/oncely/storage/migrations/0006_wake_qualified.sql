-- oncely 0006: the outbox wake-up trigger without a per-call search_path.
-- Runs inside one transaction with search_path set to the target schema.
--
-- The trigger fires once per INSERT statement on the outbox; its function used to carry
-- ``SET search_path FROM CURRENT``, which saves and restores a setting on every call. It now
-- names the members table by its schema instead (pg_notify is in pg_catalog, always found).
DO $do$ BEGIN EXECUTE
    'CREATE OR REPLACE FUNCTION oncely_outbox_wake() RETURNS trigger LANGUAGE plpgsql '
    || 'AS $body$ BEGIN IF EXISTS (SELECT 1 FROM ' || quote_ident(current_schema())
    || '.oncely_relay_members WHERE asleep) THEN PERFORM pg_notify(''oncely_outbox'', ''''); '
    || 'END IF; RETURN NULL; END $body$';
END $do$;
