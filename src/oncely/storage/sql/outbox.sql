-- The relay's statements over oncely_outbox. Each starts with "-- name: <name>".

-- name: outbox_claim
-- Lease up to :batch_size due rows, in seq order, taking only the HEAD of each key: a row is
-- claimable only if no older row of its aggregateid is still unsettled (pending, leased or
-- dead). So at most one row per key is in flight in the whole system, and a dead head parks its
-- key until an operator requeues or skips it. Claiming is by state, never by a seq cursor, so a
-- row whose transaction commits late is claimed when it becomes visible. The lease and the
-- backoff use the database clock; attempts + 1 is the fencing token settles must present.
WITH due AS (
    SELECT o.id
    FROM oncely_outbox AS o
    WHERE o.status = 'pending'
      AND o.available_at <= now()
      AND (o.lease_until IS NULL OR o.lease_until < now())
      AND NOT EXISTS (
          SELECT 1 FROM oncely_outbox AS older
          WHERE older.aggregateid = o.aggregateid
            AND older.seq < o.seq
            AND older.status = ANY (ARRAY['pending'::text, 'dead'::text])
      )
    ORDER BY o.seq
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
)
UPDATE oncely_outbox AS o
SET lease_owner = :owner,
    lease_until = now() + make_interval(secs => :lease_seconds),
    attempts = o.attempts + 1
FROM due
WHERE o.id = due.id
RETURNING o.id, o.seq, o.topic, o.aggregateid, o.type, o.payload, o.headers, o.attempts,
          o.created_at

-- name: outbox_mark_published
-- Settle confirmed rows, fenced by owner and attempt: a row another relay re-claimed since
-- (its lease expired) is not returned, and the caller counts it as lease_lost.
UPDATE oncely_outbox AS o
SET status = 'published', published_at = now(), kafka_partition = d.kafka_partition,
    kafka_offset = d.kafka_offset, lease_owner = NULL, lease_until = NULL, last_error = NULL
FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS integer[]),
            CAST(:partitions AS integer[]), CAST(:offsets AS bigint[]))
     AS d(id, attempts, kafka_partition, kafka_offset)
WHERE o.id = d.id AND o.lease_owner = :owner AND o.attempts = d.attempts
  AND o.status = 'pending'
RETURNING o.id

-- name: outbox_delete_published
-- Settle confirmed rows by deleting them (retention 0), with the same fence.
DELETE FROM oncely_outbox AS o
USING unnest(CAST(:ids AS uuid[]), CAST(:attempts AS integer[])) AS d(id, attempts)
WHERE o.id = d.id AND o.lease_owner = :owner AND o.attempts = d.attempts
  AND o.status = 'pending'
RETURNING o.id

-- name: outbox_mark_failed
-- Settle failed rows, fenced: back to pending after their backoff, or dead with the error.
UPDATE oncely_outbox AS o
SET status = CASE WHEN d.dead THEN 'dead' ELSE 'pending' END,
    available_at = now() + make_interval(secs => d.delay_seconds),
    last_error = d.error, lease_owner = NULL, lease_until = NULL
FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS integer[]),
            CAST(:delays AS double precision[]), CAST(:errors AS text[]),
            CAST(:dead AS boolean[]))
     AS d(id, attempts, delay_seconds, error, dead)
WHERE o.id = d.id AND o.lease_owner = :owner AND o.attempts = d.attempts
  AND o.status = 'pending'
RETURNING o.id, o.status

-- name: outbox_release
-- Give back leases this relay holds without a result (graceful shutdown): the rows are due
-- again at once. The attempt stays counted.
UPDATE oncely_outbox
SET lease_owner = NULL, lease_until = NULL
WHERE lease_owner = :owner AND status = 'pending' AND id = ANY (CAST(:ids AS uuid[]))
RETURNING id

-- name: outbox_purge
-- Delete one batch of settled rows older than the retention horizon.
DELETE FROM oncely_outbox
WHERE id IN (
    SELECT id FROM oncely_outbox
    WHERE status = 'published' AND published_at < now() - make_interval(secs => :older_than)
    LIMIT :batch_size
)

-- name: outbox_purge_preview
-- Per topic: the published rows outbox_purge would delete now, and the oldest of them.
SELECT topic, count(*) AS rows,
       (array_agg(id ORDER BY published_at, seq))[1] AS oldest_id,
       min(published_at) AS oldest_published_at
FROM oncely_outbox
WHERE status = 'published' AND published_at < now() - make_interval(secs => :older_than)
GROUP BY topic
ORDER BY topic

-- name: outbox_backlog
-- Per topic: unsettled depth, age of the oldest pending row, dead count (for metrics/status).
SELECT topic,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)
           AS oldest_pending_seconds
FROM oncely_outbox
WHERE status = ANY (ARRAY['pending'::text, 'dead'::text])
GROUP BY topic
ORDER BY topic

-- name: outbox_dead_list
SELECT id, seq, topic, aggregateid, type, attempts, last_error, created_at, available_at
FROM oncely_outbox
WHERE status = 'dead' AND (CAST(:topic AS text) IS NULL OR topic = :topic)
ORDER BY seq

-- name: outbox_dead_requeue
-- Dead rows back to pending with attempts reset; their keys flow again.
UPDATE oncely_outbox
SET status = 'pending', attempts = 0, available_at = now(), last_error = NULL,
    lease_owner = NULL, lease_until = NULL
WHERE status = 'dead'
  AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY (CAST(:ids AS uuid[])))
  AND (CAST(:topic AS text) IS NULL OR topic = :topic)
RETURNING id, topic, aggregateid, type

-- name: outbox_dead_skip
-- Give up on dead rows: marked skipped (kept for audit), their keys flow on.
UPDATE oncely_outbox
SET status = 'skipped', lease_owner = NULL, lease_until = NULL
WHERE status = 'dead' AND id = ANY (CAST(:ids AS uuid[]))
RETURNING id, topic, aggregateid, type

-- name: outbox_republish
-- Recovery: published rows of a window go back to pending with attempts reset; the relay
-- publishes them again under the same event ids, and consumers' receipts absorb the repeats.
UPDATE oncely_outbox
SET status = 'pending', attempts = 0, available_at = now(), published_at = NULL,
    kafka_partition = NULL, kafka_offset = NULL, lease_owner = NULL, lease_until = NULL
WHERE status = 'published'
  AND created_at >= :since
  AND (CAST(:until AS timestamptz) IS NULL OR created_at < :until)
  AND (CAST(:type AS text) IS NULL OR type = :type)
RETURNING id

-- name: outbox_republish_count
SELECT count(*) FROM oncely_outbox
WHERE status = 'published'
  AND created_at >= :since
  AND (CAST(:until AS timestamptz) IS NULL OR created_at < :until)
  AND (CAST(:type AS text) IS NULL OR type = :type)

-- name: outbox_pending_among
SELECT count(*) FILTER (WHERE status = 'pending') AS waiting,
       count(*) FILTER (WHERE status = 'dead') AS dead
FROM oncely_outbox
WHERE id = ANY (CAST(:ids AS uuid[]))
