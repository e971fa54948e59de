-- Read-only statements of `oncely status`, `oncely verify` and `oncely replay --from-outbox`.
-- Each starts with "-- name: <name>".
-- None of them writes; the callers run them in READ ONLY transactions.

-- name: ops_parked_by_topic
-- Per topic: keys parked by a dead row and by a delayed row, rows held behind parked keys, and
-- dead rows an operator asked to requeue or skip that no relay has carried out yet.
SELECT p.topic,
       count(*) FILTER (WHERE p.reason = 'dead') AS dead,
       count(*) FILTER (WHERE p.reason = 'delayed') AS delayed,
       count(*) AS held_keys,
       COALESCE(sum(h.held), 0) AS held_rows,
       count(*) FILTER (WHERE p.request IS NOT NULL) AS requested
FROM oncely_relay_parked AS p
LEFT JOIN (SELECT topic, aggregateid, count(*) AS held
           FROM oncely_relay_held
           GROUP BY topic, aggregateid) AS h USING (topic, aggregateid)
GROUP BY p.topic
ORDER BY p.topic

-- name: ops_receipts_by_effect
-- Per effect name found in the receipts: receipts in all, and those of the last :recent_seconds.
SELECT effect,
       count(*) AS applied,
       count(*) FILTER (WHERE applied_at >= now() - make_interval(secs => :recent_seconds))
           AS applied_recently
FROM oncely_receipts
GROUP BY effect
ORDER BY effect

-- name: ops_tasks_by_status
SELECT status, count(*) AS tasks
FROM oncely_tasks
GROUP BY status

-- name: verify_now
-- The database clock, fixed for the whole (REPEATABLE READ) verification transaction.
SELECT now()

-- name: verify_outbox_summary
-- The window's rows by state. A row is "published" once its shard's recorded progress has
-- passed it (every record of its page was acknowledged) and it is neither a parked key's own
-- row (dead or delayed) nor held behind one; "unpublished": the progress has not passed it yet.
-- "stuck": not published and due (created, and available) longer than :max_pending_age ago.
WITH w AS (
    SELECT o.created_at, o.available_at,
           pg_visible_in_snapshot(o.txid, s.done)
            OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                AND pg_visible_in_snapshot(o.txid, s.reading)) AS passed,
           p.reason AS parked,
           EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id) AS held
    FROM oncely_outbox AS o
    JOIN oncely_relay_shards AS s ON s.shard = o.shard
    LEFT JOIN oncely_relay_parked AS p ON p.event_id = o.id
    WHERE o.created_at >= :since AND o.created_at < :until
), states AS (
    SELECT created_at, available_at,
           CASE WHEN NOT passed THEN 'unpublished'
                WHEN parked = 'dead' THEN 'dead'
                WHEN parked IS NOT NULL OR held THEN 'held'
                ELSE 'published' END AS state
    FROM w
)
SELECT count(*) AS committed,
       count(*) FILTER (WHERE state = 'published') AS published,
       count(*) FILTER (WHERE state = 'unpublished') AS unpublished,
       count(*) FILTER (WHERE state = 'dead') AS dead,
       count(*) FILTER (WHERE state = 'held') AS held,
       count(*) FILTER (WHERE state <> 'published'
                          AND greatest(created_at, available_at)
                              < now() - make_interval(secs => :max_pending_age)) AS stuck,
       CAST(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE state <> 'published'))
            AS double precision) AS oldest_unpublished_seconds
FROM states

-- name: verify_stuck
-- The first :limit stuck rows of the window (see verify_outbox_summary), oldest first, with
-- the error of a dead row.
SELECT id, topic, aggregateid, state, error, age_seconds
FROM (
    SELECT o.id, o.seq, o.topic, o.aggregateid, o.created_at, o.available_at, p.error,
           CAST(EXTRACT(EPOCH FROM now() - o.created_at) AS double precision) AS age_seconds,
           CASE WHEN NOT (pg_visible_in_snapshot(o.txid, s.done)
            OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                AND pg_visible_in_snapshot(o.txid, s.reading))) THEN 'unpublished'
                WHEN p.reason = 'dead' THEN 'dead'
                WHEN p.reason IS NOT NULL
                     OR EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)
                     THEN 'held'
                ELSE 'published' END AS state
    FROM oncely_outbox AS o
    JOIN oncely_relay_shards AS s ON s.shard = o.shard
    LEFT JOIN oncely_relay_parked AS p ON p.event_id = o.id
    WHERE o.created_at >= :since AND o.created_at < :until
      AND greatest(o.created_at, o.available_at) < now() - make_interval(secs => :max_pending_age)
) AS rows
WHERE state <> 'published'
ORDER BY seq
LIMIT :limit

-- name: verify_published
-- The window's published rows (see verify_outbox_summary) by topic: the ids to find in each
-- topic. Streamed through a server-side cursor.
SELECT o.id, o.topic
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
WHERE o.created_at >= :since AND o.created_at < :until
  AND (pg_visible_in_snapshot(o.txid, s.done)
            OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                AND pg_visible_in_snapshot(o.txid, s.reading)))
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)
ORDER BY o.topic

-- name: verify_effect_summary
-- For one effect: the window's published rows of the types it consumes, and how many of them
-- have its receipt. The receipts' primary key (event_id, effect) allows at most one each.
SELECT count(*) AS expected, count(r.event_id) AS applied
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
LEFT JOIN oncely_receipts AS r ON r.event_id = o.id AND r.effect = :effect
WHERE o.created_at >= :since AND o.created_at < :until
  AND o.type = ANY (CAST(:types AS text[]))
  AND (pg_visible_in_snapshot(o.txid, s.done)
            OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                AND pg_visible_in_snapshot(o.txid, s.reading)))
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)

-- name: verify_not_applied
-- The first :limit published rows of the window, of the effect's types, without its receipt.
SELECT o.id
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
WHERE o.created_at >= :since AND o.created_at < :until
  AND o.type = ANY (CAST(:types AS text[]))
  AND (pg_visible_in_snapshot(o.txid, s.done)
            OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                AND pg_visible_in_snapshot(o.txid, s.reading)))
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

-- name: republish_summary
-- The outbox rows created in [:since, :until) (of type :type when given), per topic: how many,
-- how many no shard's progress has passed yet (not acknowledged), how many belong to parked
-- keys; with the oldest row the outbox still holds (seq and created_at: rows before it were
-- purged, or never existed). One scan of the table.
WITH rows AS (
    SELECT o.topic, o.seq, o.created_at,
           o.created_at >= :since
               AND (CAST(:until AS timestamptz) IS NULL OR o.created_at < :until)
               AND (CAST(:type AS text) IS NULL OR o.type = :type) AS in_window,
           pg_visible_in_snapshot(o.txid, s.done)
               OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                   AND pg_visible_in_snapshot(o.txid, s.reading)) AS passed,
           EXISTS (SELECT 1 FROM oncely_relay_parked AS p
                   WHERE p.topic = o.topic AND p.aggregateid = o.aggregateid) AS parked
    FROM oncely_outbox AS o
    JOIN oncely_relay_shards AS s ON s.shard = o.shard
), first AS (
    SELECT min(seq) AS first_seq, min(created_at) AS first_created_at FROM rows
)
SELECT w.topic, count(w.topic) AS rows, count(*) FILTER (WHERE NOT w.passed) AS unpublished,
       count(*) FILTER (WHERE w.parked) AS parked, f.first_seq, f.first_created_at
FROM first AS f
LEFT JOIN rows AS w ON w.in_window
GROUP BY w.topic, f.first_seq, f.first_created_at
ORDER BY w.topic

-- name: republish_parked_keys
-- Up to :limit parked keys that have rows in the window, with the row that parked each.
SELECT DISTINCT p.topic, p.aggregateid, p.event_id, p.reason
FROM oncely_relay_parked AS p
JOIN oncely_outbox AS o ON o.topic = p.topic AND o.aggregateid = p.aggregateid
WHERE o.created_at >= :since
  AND (CAST(:until AS timestamptz) IS NULL OR o.created_at < :until)
  AND (CAST(:type AS text) IS NULL OR o.type = :type)
ORDER BY p.topic, p.aggregateid
LIMIT :limit

-- name: republish_rows
-- The window's rows in seq order, as the relay reads them (streamed from a server-side cursor).
SELECT CAST(o.id AS text) AS id, o.seq, o.shard, o.topic, o.aggregateid, o.type, o.payload,
       CAST(o.headers AS text) AS headers,
       CAST(floor(extract(epoch FROM o.created_at) * 1000) AS bigint) AS timestamp_ms,
       CAST(NULL AS timestamptz) AS available_at
FROM oncely_outbox AS o
WHERE o.created_at >= :since
  AND (CAST(:until AS timestamptz) IS NULL OR o.created_at < :until)
  AND (CAST(:type AS text) IS NULL OR o.type = :type)
ORDER BY o.seq
