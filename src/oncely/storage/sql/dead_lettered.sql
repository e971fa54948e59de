-- Records an effect's consumer dead-lettered. Each statement starts with "-- name: <name>".

-- name: dead_lettered_record
-- A record confirmed in the effect's DLQ topic, before the consumer commits past it. It is no
-- receipt: a redrive applies the event and writes one. A second dead letter of the same event
-- keeps the first row.
INSERT INTO oncely_dead_lettered (event_id, effect, topic, partition, "offset", reason)
VALUES (:event_id, :effect, :topic, :partition, :offset, :reason)
ON CONFLICT ON CONSTRAINT oncely_dead_lettered_pkey DO NOTHING

-- name: lookup_dead_lettered
-- The dead letters of one event, one per effect whose consumer dead-lettered it (the console's
-- event lookup).
SELECT event_id, effect, topic, partition, "offset", reason, dead_lettered_at
FROM oncely_dead_lettered
WHERE event_id = :id
ORDER BY effect

-- name: dead_lettered_recent
-- The newest :limit dead letters no receipt has followed (the event was not applied since, by
-- a redrive), newest first (the console's dead letters).
SELECT l.event_id, l.effect, l.topic, l.partition, l."offset", l.reason, l.dead_lettered_at
FROM oncely_dead_lettered AS l
WHERE NOT EXISTS (SELECT 1 FROM oncely_receipts AS r
                  WHERE r.event_id = l.event_id AND r.effect = l.effect)
ORDER BY l.dead_lettered_at DESC
LIMIT :limit
