-- Effect receipts. Each statement starts with "-- name: <name>".

-- name: receipt_insert
-- The effect's evidence, in the same transaction as the effect. Only this constraint's
-- conflict means "already applied": no row is returned and the handler is not called. Any
-- other error propagates.
INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset")
VALUES (:event_id, :effect, :topic, :partition, :offset)
ON CONFLICT ON CONSTRAINT oncely_receipts_pkey DO NOTHING
RETURNING event_id

-- name: receipts_insert_many
-- The receipts of a run of records in one statement; returns only the event ids that already
-- had a receipt (the duplicates), usually none. A second copy of an event id in the same run is
-- not returned: the caller tells it apart.
WITH batch AS (
    SELECT * FROM unnest(
        CAST(:event_ids AS uuid[]),
        CAST(:topics AS text[]),
        CAST(:partitions AS integer[]),
        CAST(:offsets AS bigint[])
    ) AS r (event_id, topic, partition, "offset")
), inserted AS (
    INSERT INTO oncely_receipts (event_id, effect, topic, partition, "offset")
    SELECT b.event_id, :effect, b.topic, b.partition, b."offset" FROM batch b
    ON CONFLICT ON CONSTRAINT oncely_receipts_pkey DO NOTHING
    RETURNING event_id
)
SELECT b.event_id FROM batch b
WHERE NOT EXISTS (SELECT FROM inserted i WHERE i.event_id = b.event_id)

-- name: receipts_purge
-- Delete one batch of an effect's receipts older than the horizon.
DELETE FROM oncely_receipts
WHERE (event_id, effect) IN (
    SELECT event_id, effect FROM oncely_receipts
    WHERE effect = :effect AND applied_at < now() - make_interval(secs => :older_than)
    LIMIT :batch_size
)

-- name: receipts_purge_preview
-- How many of an effect's receipts receipts_purge would delete now, and the oldest one's time.
SELECT count(*) AS receipts, min(applied_at) AS oldest_applied_at
FROM oncely_receipts
WHERE effect = :effect AND applied_at < now() - make_interval(secs => :older_than)
