-- oncely 0013: a dead row's attempts and first failure, for operators.
-- Runs inside one transaction with search_path set to the target schema.
--
-- The relay parks a key by a dead row after the row's own attempts (ONCELY_RELAY_MAX_ATTEMPTS)
-- failed: it now records how many, and when the first failed; the last failure is parked_at.
-- Rows parked before this migration, and delayed or blocked rows, have neither (NULL).
ALTER TABLE oncely_relay_parked ADD COLUMN attempts integer, ADD COLUMN first_failed_at timestamptz;
