-- oncely 0005: a key parked because its topic does not exist (or is not authorised).
-- Runs inside one transaction with search_path set to the target schema.
--
-- The relay parks the first row of each key of a topic the broker does not know (or refuses to
-- describe) as 'blocked', holds the key's later rows behind it, and publishes them in order by
-- itself once the topic exists: other topics and keys keep flowing meanwhile.
ALTER TABLE oncely_relay_parked DROP CONSTRAINT oncely_relay_parked_reason_check;
ALTER TABLE oncely_relay_parked ADD CONSTRAINT oncely_relay_parked_reason_check
    CHECK (reason IN ('dead', 'delayed', 'blocked'));
