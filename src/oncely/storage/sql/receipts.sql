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
-- had a receipt (the duplicates, as canonical UUID text), usually none. A second copy of an
-- event id in the same run is not returned: the caller tells it apart. The ids may come as
-- text: the cast reads any spelling PostgreSQL's uuid type accepts.
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
SELECT CAST(b.event_id AS text) FROM batch b
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

-- Operators' reads (READ ONLY transactions): `oncely status` and `oncely verify`.

-- name: ops_receipts_by_effect
-- Per effect name found in the receipts: receipts in all, and those of the last :recent_seconds.
SELECT effect,
       count(*) AS applied,
       count(*) FILTER (WHERE applied_at >= now() - make_interval(secs => :recent_seconds))
           AS applied_recently
FROM oncely_receipts
GROUP BY effect
ORDER BY effect

-- name: verify_effect_summary
-- For one effect: the window's published rows of the types it consumes, and how many of them
-- have its receipt. The receipts' primary key (event_id, effect) allows at most one each.
SELECT count(*) AS expected, count(r.event_id) AS applied
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
LEFT JOIN oncely_receipts AS r ON r.event_id = o.id AND r.effect = :effect
WHERE o.created_at >= :since AND o.created_at < :until
  AND o.type = ANY (CAST(:types AS text[]))
  AND oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)

-- name: verify_not_applied
-- The first :limit published rows of the window, of the effect's types, without its receipt.
SELECT o.id
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
WHERE o.created_at >= :since AND o.created_at < :until
  AND o.type = ANY (CAST(:types AS text[]))
  AND oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)
  AND NOT EXISTS (
      SELECT 1 FROM oncely_receipts AS r WHERE r.event_id = o.id AND r.effect = :effect
  )
ORDER BY o.seq
LIMIT :limit

-- name: verify_out_of_order
-- For one effect, per topic and key: an applied event whose receipt is older than the receipt
-- of the key's previous applied event (in seq order) ran ahead of it. Kafka orders a key only
-- within its topic's partition, so keys are compared within a topic. Returns the first
-- violations (at least one, whatever :limit, so that the total count is never lost), each with
-- the total count.
WITH applied AS (
    SELECT o.id, o.seq, r.applied_at,
           lag(r.applied_at) OVER key_order AS previous_applied_at,
           lag(o.id) OVER key_order AS previous_id
    FROM oncely_outbox AS o
    JOIN oncely_receipts AS r ON r.event_id = o.id AND r.effect = :effect
    WHERE o.created_at >= :since AND o.created_at < :until
      AND o.type = ANY (CAST(:types AS text[]))
    WINDOW key_order AS (PARTITION BY o.topic, o.aggregateid ORDER BY o.seq)
)
SELECT id, previous_id, count(*) OVER () AS total
FROM applied
WHERE applied_at < previous_applied_at
ORDER BY seq
LIMIT GREATEST(:limit, 1)

-- name: receipts_applied
-- Which of the events :ids the effects :effects applied: one row per (event, effect) receipt
-- (the test harness waits on them: oncely.testing).
SELECT event_id, effect
FROM oncely_receipts
WHERE event_id = ANY (CAST(:ids AS uuid[])) AND effect = ANY (CAST(:effects AS text[]))

-- name: lookup_receipts
-- The receipts of one event, one per effect that applied it (the console's event lookup).
SELECT effect, topic, partition, "offset", applied_at, outcome
FROM oncely_receipts
WHERE event_id = :id
ORDER BY effect

-- Completeness: the events an effect is expected to have applied, checked against its receipts
-- (oncely.consumers.completeness). Event ids are UUIDv7: their leading 48 bits are the staging
-- time in milliseconds, so a time bucket is an id range, read from the primary keys' indexes.

-- name: completeness_bounds
-- The oldest event id still in the outbox (NULL when it is empty) and the database clock, in
-- milliseconds since the epoch.
SELECT (SELECT id FROM oncely_outbox ORDER BY id LIMIT 1) AS oldest_id,
       CAST(floor(extract(epoch FROM now()) * 1000) AS bigint) AS now_ms

-- name: completeness_buckets
-- Per bucket [lows[n], highs[n]) of event ids, in order: the outbox rows of :types (how many,
-- and the sum of their ids' hashes), and the events the effect holds a receipt for or
-- dead-lettered (a dead letter of an event applied since is counted once, as its receipt).
-- The two agree when both the count and the sum do; only buckets that disagree are read row by
-- row (completeness_missing).
SELECT b.n, e.events, e.events_hash, d.done, d.done_hash
FROM unnest(CAST(:lows AS uuid[]), CAST(:highs AS uuid[])) WITH ORDINALITY AS b (low, high, n)
CROSS JOIN LATERAL (
    SELECT count(*) AS events, COALESCE(sum(uuid_hash(o.id)), 0) AS events_hash
    FROM oncely_outbox AS o
    WHERE o.id >= b.low AND o.id < b.high AND o.type = ANY (CAST(:types AS text[]))
) AS e
CROSS JOIN LATERAL (
    SELECT count(*) AS done, COALESCE(sum(uuid_hash(x.event_id)), 0) AS done_hash
    FROM (
        SELECT r.event_id FROM oncely_receipts AS r
        WHERE r.event_id >= b.low AND r.event_id < b.high AND r.effect = :effect
        UNION ALL
        SELECT l.event_id FROM oncely_dead_lettered AS l
        WHERE l.event_id >= b.low AND l.event_id < b.high AND l.effect = :effect
          AND NOT EXISTS (SELECT 1 FROM oncely_receipts AS r
                          WHERE r.event_id = l.event_id AND r.effect = :effect)
    ) AS x
) AS d
ORDER BY b.n

-- name: completeness_missing
-- The events of :types in the id ranges [lows[i], highs[i]) the effect is expected to have
-- applied and has not: published (their shard's progress passed them, and they are neither a
-- parked key's own row, dead or delayed, nor held behind one), not skipped, with neither a
-- receipt nor a dead letter of the effect. How many, and the first :limit ids (oldest first)
-- with the oldest one's created_at.
WITH missing AS (
    SELECT o.id, o.created_at
    FROM unnest(CAST(:lows AS uuid[]), CAST(:highs AS uuid[])) AS b (low, high)
    JOIN oncely_outbox AS o ON o.id >= b.low AND o.id < b.high
    JOIN oncely_relay_shards AS s ON s.shard = o.shard
    WHERE o.type = ANY (CAST(:types AS text[]))
      AND oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
      AND NOT EXISTS (SELECT 1 FROM oncely_receipts AS r
                      WHERE r.event_id = o.id AND r.effect = :effect)
      AND NOT EXISTS (SELECT 1 FROM oncely_dead_lettered AS l
                      WHERE l.event_id = o.id AND l.effect = :effect)
      AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
      AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)
      AND NOT EXISTS (SELECT 1 FROM oncely_relay_skipped AS k WHERE k.event_id = o.id)
)
SELECT (SELECT count(*) FROM missing) AS missing,
       (SELECT min(created_at) FROM missing) AS oldest_created_at,
       ARRAY(SELECT id FROM missing ORDER BY id LIMIT :limit) AS sample
