-- The producer's statement on oncely_outbox: what stage() and stage_many() add, in the caller's
-- own transaction. Each starts with "-- name: <name>".

-- name: outbox_stage
-- Add one staged row; a batch of n rows repeats the VALUES row n times (one statement, so the
-- wake-up trigger fires once per batch, not per row), and the INSERT numbers seq in VALUES
-- order: a batch keeps its order. Columns left out take the table's defaults (created_at,
-- txid, shard); available_at is now() unless given. No RETURNING: the caller built every value
-- it reports.
INSERT INTO oncely_outbox
    (id, aggregatetype, aggregateid, type, topic, payload, headers, event_key, available_at,
     tracingspancontext)
VALUES
    (:id, :aggregatetype, :aggregateid, :type, :topic, :payload, CAST(:headers AS jsonb),
     :event_key, coalesce(CAST(:available_at AS timestamptz), now()), :tracingspancontext)
