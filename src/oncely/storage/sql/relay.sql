-- The relay's statements: snapshot reads of oncely_outbox per leased shard, progress, leases,
-- parked keys and held rows. Each starts with "-- name: <name>".

-- name: relay_snapshot
-- The snapshot a read compares with the shards' progress, and the database clock.
SELECT CAST(pg_current_snapshot() AS text) AS snapshot, now() AS now

-- name: relay_read
-- One page of the rows of :shards (columns in OutboxRow's field order, as records.py says) visible in the reading snapshot and not in the shards' done
-- snapshot, after :after_seq, in seq order. The caller passes the difference as PgQ does:
-- txids in [done.xmax, reading.xmax) not running in reading, plus the txids that were running
-- in done and are visible in reading. Below done.xmax nothing else can be new, so a long-open
-- transaction never makes a read rescan the rows written since it began.
SELECT CAST(o.id AS text) AS id, o.seq, o.shard, o.topic, o.aggregateid, o.type, o.payload,
       CAST(o.headers AS text) AS headers,
       CAST(floor(extract(epoch FROM o.created_at) * 1000) AS bigint) AS timestamp_ms,
       CASE WHEN o.available_at > now() THEN o.available_at END AS available_at
FROM oncely_outbox AS o
WHERE o.shard = ANY (CAST(:shards AS smallint[]))
  AND o.seq > :after_seq
  AND ((o.txid >= CAST(:low AS xid8) AND o.txid < CAST(:high AS xid8)
        AND o.txid <> ALL (CAST(:running AS xid8[])))
       OR o.txid = ANY (CAST(:finished AS xid8[])))
ORDER BY o.seq
LIMIT :page_size

-- name: relay_rows
-- Outbox rows by id, for releasing a parked key (its own row and the rows held behind it).
SELECT CAST(o.id AS text) AS id, o.seq, o.shard, o.topic, o.aggregateid, o.type, o.payload,
       CAST(o.headers AS text) AS headers,
       CAST(floor(extract(epoch FROM o.created_at) * 1000) AS bigint) AS timestamp_ms,
       CAST(NULL AS timestamptz) AS available_at
FROM oncely_outbox AS o
WHERE o.id = ANY (CAST(:ids AS uuid[]))

-- name: relay_record
-- Progress of shards whose pages are all acknowledged, fenced by the lease epoch: a shard this
-- relay no longer holds (another relay took it over) is not returned, and nothing of it moves.
UPDATE oncely_relay_shards AS s
SET done = CAST(p.done AS pg_snapshot), reading = CAST(p.reading AS pg_snapshot),
    after_seq = p.after_seq, updated_at = now()
FROM unnest(CAST(:shards AS smallint[]), CAST(:epochs AS bigint[]), CAST(:dones AS text[]),
            CAST(:readings AS text[]), CAST(:afters AS bigint[]))
     AS p(shard, epoch, done, reading, after_seq)
WHERE s.shard = p.shard AND s.owner = :owner AND s.epoch = p.epoch
RETURNING s.shard

-- name: relay_park
-- Park keys (dead or delayed rows), fenced like progress; a key parked already stays as is.
INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, error, until)
SELECT p.topic, p.aggregateid, p.shard, p.event_id, p.reason, p.error, p.until
FROM unnest(CAST(:topics AS text[]), CAST(:keys AS text[]), CAST(:shards AS smallint[]),
            CAST(:event_ids AS uuid[]), CAST(:reasons AS text[]), CAST(:errors AS text[]),
            CAST(:untils AS timestamptz[]), CAST(:epochs AS bigint[]))
     AS p(topic, aggregateid, shard, event_id, reason, error, until, epoch)
JOIN oncely_relay_shards AS s ON s.shard = p.shard AND s.owner = :owner AND s.epoch = p.epoch
ON CONFLICT (topic, aggregateid) DO NOTHING

-- name: relay_hold
-- Rows read behind parked keys, in the order given.
INSERT INTO oncely_relay_held (event_id, topic, aggregateid)
SELECT h.event_id, h.topic, h.aggregateid
FROM unnest(CAST(:event_ids AS uuid[]), CAST(:topics AS text[]), CAST(:keys AS text[]))
     WITH ORDINALITY AS h(event_id, topic, aggregateid, n)
ORDER BY h.n

-- name: relay_parked
-- The parked keys of :shards, with whether a delayed one is due (database clock).
SELECT topic, aggregateid, shard, event_id, reason, error, until, request,
       reason = 'delayed' AND until <= now() AS due
FROM oncely_relay_parked
WHERE shard = ANY (CAST(:shards AS smallint[]))

-- name: relay_held_of
-- The rows held behind one parked key, in read order.
SELECT position, event_id FROM oncely_relay_held
WHERE topic = :topic AND aggregateid = :aggregateid
ORDER BY position

-- name: relay_unhold
-- Held rows now published; fenced by the shard's epoch.
DELETE FROM oncely_relay_held AS h
USING oncely_relay_shards AS s
WHERE h.topic = :topic AND h.aggregateid = :aggregateid AND h.position <= :position
  AND s.shard = :shard AND s.owner = :owner AND s.epoch = :epoch

-- name: relay_unpark
-- Release a key once nothing is held behind it; fenced by the shard's epoch.
DELETE FROM oncely_relay_parked AS p
USING oncely_relay_shards AS s
WHERE p.topic = :topic AND p.aggregateid = :aggregateid
  AND s.shard = p.shard AND s.owner = :owner AND s.epoch = :epoch
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h
                  WHERE h.topic = p.topic AND h.aggregateid = p.aggregateid)
RETURNING p.event_id

-- name: relay_park_failed
-- A release whose own row failed again: it stays parked (dead) with the new error.
UPDATE oncely_relay_parked
SET reason = 'dead', error = :error, until = NULL, request = NULL
WHERE topic = :topic AND aggregateid = :aggregateid

-- name: relay_heartbeat
-- This relay is alive (and asleep or not); forget relays silent for a minute. Returns how many
-- relays are alive, which decides each one's fair share of the shards.
WITH beat AS (
    INSERT INTO oncely_relay_members (relay_id, heartbeat_until, asleep)
    VALUES (:relay_id, now() + make_interval(secs => :ttl_seconds), :asleep)
    ON CONFLICT (relay_id) DO UPDATE
    SET heartbeat_until = EXCLUDED.heartbeat_until, asleep = EXCLUDED.asleep
), gone AS (
    DELETE FROM oncely_relay_members
    WHERE heartbeat_until < now() - interval '1 minute' AND relay_id <> :relay_id
)
SELECT 1 + count(*) AS alive, (SELECT count(*) FROM oncely_relay_shards) AS shards
FROM oncely_relay_members
WHERE heartbeat_until > now() AND relay_id <> :relay_id

-- name: relay_sleep
-- Ask staging to NOTIFY (asleep) or stop asking (awake).
UPDATE oncely_relay_members SET asleep = :asleep WHERE relay_id = :relay_id

-- name: relay_leave
DELETE FROM oncely_relay_members WHERE relay_id = :relay_id

-- name: relay_renew
-- Extend the leases this relay still holds; a shard not returned was taken over.
UPDATE oncely_relay_shards AS s
SET lease_until = now() + make_interval(secs => :lease_seconds)
FROM unnest(CAST(:shards AS smallint[]), CAST(:epochs AS bigint[])) AS p(shard, epoch)
WHERE s.shard = p.shard AND s.owner = :owner AND s.epoch = p.epoch
RETURNING s.shard

-- name: relay_acquire
-- Take up to :wanted shards that nobody holds (released, or lease expired), bumping the epoch
-- so that the previous holder's progress writes are refused from now on.
WITH free AS (
    SELECT shard FROM oncely_relay_shards
    WHERE owner IS NULL OR lease_until < now()
    ORDER BY owner IS NOT NULL, shard
    LIMIT :wanted
    FOR UPDATE SKIP LOCKED
)
UPDATE oncely_relay_shards AS s
SET owner = :owner, epoch = s.epoch + 1,
    lease_until = now() + make_interval(secs => :lease_seconds)
FROM free
WHERE s.shard = free.shard
RETURNING s.shard, s.epoch, CAST(s.done AS text) AS done, CAST(s.reading AS text) AS reading,
          s.after_seq

-- name: relay_release
-- Give shards back (graceful hand-off); their progress stays.
UPDATE oncely_relay_shards AS s
SET owner = NULL, lease_until = NULL
FROM unnest(CAST(:shards AS smallint[]), CAST(:epochs AS bigint[])) AS p(shard, epoch)
WHERE s.shard = p.shard AND s.owner = :owner AND s.epoch = p.epoch
RETURNING s.shard

-- name: relay_backlog
-- Per shard and topic: rows committed and not yet acknowledged, and the oldest one's age.
SELECT s.shard, o.topic, count(*) AS unpublished,
       EXTRACT(EPOCH FROM now() - min(o.created_at)) AS oldest_seconds
FROM oncely_relay_shards AS s
JOIN oncely_outbox AS o
  ON o.shard = s.shard AND o.txid >= pg_snapshot_xmin(s.done)
WHERE NOT pg_visible_in_snapshot(o.txid, s.done)
  AND NOT (s.reading IS NOT NULL AND pg_visible_in_snapshot(o.txid, s.reading)
           AND o.seq <= s.after_seq)
GROUP BY s.shard, o.topic
ORDER BY s.shard, o.topic

-- name: relay_shards
-- Every shard's progress and lease, for status and metrics.
SELECT shard, owner, epoch, lease_until > now() AS leased, lease_until, updated_at,
       EXTRACT(EPOCH FROM now() - updated_at) AS progress_age_seconds
FROM oncely_relay_shards
ORDER BY shard

-- name: relay_purge
-- Delete one batch of rows older than the horizon that their shard's progress has passed
-- (every snapshot after it sees them), except those of parked keys.
DELETE FROM oncely_outbox
WHERE id IN (
    SELECT o.id
    FROM oncely_relay_shards AS s
    JOIN oncely_outbox AS o ON o.shard = s.shard AND o.txid < pg_snapshot_xmin(s.done)
    WHERE o.created_at < now() - make_interval(secs => :older_than)
      AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p
                      WHERE p.topic = o.topic AND p.aggregateid = o.aggregateid)
    LIMIT :batch_size
)

-- name: relay_purge_preview
-- Per topic: the rows relay_purge would delete now, and the oldest of them.
SELECT o.topic, count(*) AS rows, (array_agg(o.id ORDER BY o.seq))[1] AS oldest_id,
       min(o.created_at) AS oldest_created_at
FROM oncely_relay_shards AS s
JOIN oncely_outbox AS o ON o.shard = s.shard AND o.txid < pg_snapshot_xmin(s.done)
WHERE o.created_at < now() - make_interval(secs => :older_than)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p
                  WHERE p.topic = o.topic AND p.aggregateid = o.aggregateid)
GROUP BY o.topic
ORDER BY o.topic

-- name: dead_list
-- Dead rows (each parks its key) with how many rows are held behind them.
SELECT p.event_id AS id, o.seq, p.topic, p.aggregateid, o.type, p.error, p.parked_at,
       o.created_at, p.request,
       (SELECT count(*) FROM oncely_relay_held AS h
        WHERE h.topic = p.topic AND h.aggregateid = p.aggregateid) AS held
FROM oncely_relay_parked AS p
LEFT JOIN oncely_outbox AS o ON o.id = p.event_id
WHERE p.reason = 'dead' AND (CAST(:topic AS text) IS NULL OR p.topic = :topic)
ORDER BY p.parked_at, o.seq

-- name: dead_request
-- Ask the relay holding the key's shard to requeue or skip dead rows.
UPDATE oncely_relay_parked
SET request = :request
WHERE reason = 'dead'
  AND (CAST(:ids AS uuid[]) IS NULL OR event_id = ANY (CAST(:ids AS uuid[])))
  AND (CAST(:topic AS text) IS NULL OR topic = :topic)
RETURNING event_id AS id, topic, aggregateid
