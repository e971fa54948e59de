-- oncely 0007: "the shard's progress has passed this row", written once.
-- Runs inside one transaction with search_path set to the target schema.
--
-- A row is passed when its shard's recorded progress covers it: the shard's done snapshot sees
-- its transaction, or a page read from the reading snapshot that sees it was acknowledged up to
-- and past its seq. Status, verify, republish and the receipts' purge ask this of a row (the
-- relay's reads and purge use the snapshot bounds instead, which an index can serve). One SQL
-- expression: the planner inlines it where it is called.
CREATE OR REPLACE FUNCTION oncely_passed(
    txid xid8, seq bigint, done pg_snapshot, reading pg_snapshot, after_seq bigint
) RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_visible_in_snapshot(txid, done)
        OR (reading IS NOT NULL AND seq <= after_seq AND pg_visible_in_snapshot(txid, reading))
$$;
