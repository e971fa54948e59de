-- oncely 0012: what completeness does not expect of an effect, recorded where it happens.
-- Runs inside one transaction with search_path set to the target schema.
--
-- An outbox row given up with `oncely dead skip` is never published: once the relay carries
-- the skip out it records the row here, in the transaction that releases the key, so that no
-- effect is expected to apply it (the parked entry that said so is deleted with the release).
CREATE TABLE oncely_relay_skipped (
    event_id    uuid NOT NULL,
    topic       text NOT NULL,
    aggregateid text NOT NULL,
    skipped_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_relay_skipped_pkey PRIMARY KEY (event_id)
);

-- A record an effect's consumer dead-lettered (to <topic>.<effect>.dlq, confirmed) gets no
-- receipt, so that a redrive applies it; the consumer records it here before it commits past
-- it, so that completeness counts the event as dead for that effect, not missing. The key's
-- leading column is the event id: an id range (a time bucket) is an index range.
CREATE TABLE oncely_dead_lettered (
    event_id         uuid NOT NULL,
    effect           text NOT NULL,
    topic            text NOT NULL,
    partition        integer NOT NULL,
    "offset"         bigint NOT NULL,
    reason           text NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_dead_lettered_pkey PRIMARY KEY (event_id, effect)
);
