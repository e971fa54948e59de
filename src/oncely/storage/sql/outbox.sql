-- The store of oncely_outbox and the relay's tables (shards, members, parked keys, held rows).
-- First the relay's statements: snapshot reads per leased shard, progress, leases, parked keys
-- and held rows. Each starts with "-- name: <name>".

-- fragment: row_to_publish
-- The columns of a row to publish (of the outbox row "o"), in the order OutboxRow.of reads them
-- (rows.py); each statement adds the row's delay, available_at, last.
CAST(o.id AS text) AS id, o.seq, o.shard, o.topic, o.aggregateid, o.type, o.payload,
CAST(o.headers AS text) AS headers,
CAST(extract(epoch FROM o.created_at) * 1000000 AS bigint) AS created_us,
o.tracingspancontext

-- name: relay_snapshot
-- The snapshot a read compares with the shards' progress, and the database clock.
SELECT CAST(pg_current_snapshot() AS text) AS snapshot, now() AS now

-- name: relay_read
-- One page of the rows of :shards visible in the reading snapshot and not in the shards' done
-- snapshot, after :after_seq, in seq order. The caller passes the difference as PgQ does:
-- txids in [done.xmax, reading.xmax) not running in reading, plus the txids that were running
-- in done and are visible in reading. Below done.xmax nothing else can be new, so a long-open
-- transaction never makes a read rescan the rows written since it began.
SELECT {row_to_publish},
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
-- Outbox rows by id, for releasing a parked key (its own row and the rows held behind it):
-- from the outbox, or from oncely_relay_kept once retention dropped their partition (a row is
-- in one or the other: the copy and the drop commit together).
SELECT {row_to_publish}, CAST(NULL AS timestamptz) AS available_at
FROM oncely_outbox AS o
WHERE o.id = ANY (CAST(:ids AS uuid[]))
UNION ALL
SELECT {row_to_publish}, CAST(NULL AS timestamptz) AS available_at
FROM oncely_relay_kept AS o
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
-- Park keys (dead, delayed or blocked rows), fenced like progress; a key parked already stays as is.
-- A dead row comes with its attempts and the moment the first failed.
INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, error, until,
                                 attempts, first_failed_at)
SELECT p.topic, p.aggregateid, p.shard, p.event_id, p.reason, p.error, p.until, p.attempts,
       p.first_failed_at
FROM unnest(CAST(:topics AS text[]), CAST(:keys AS text[]), CAST(:shards AS smallint[]),
            CAST(:event_ids AS uuid[]), CAST(:reasons AS text[]), CAST(:errors AS text[]),
            CAST(:untils AS timestamptz[]), CAST(:attempts AS integer[]),
            CAST(:firsts AS timestamptz[]), CAST(:epochs AS bigint[]))
     AS p(topic, aggregateid, shard, event_id, reason, error, until, attempts, first_failed_at,
          epoch)
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

-- name: relay_unkeep
-- Delete the kept copies of a key's rows that are neither parked nor held any more (published,
-- or skipped), in the transaction that released them; fenced by the shard's epoch. A copy
-- that retention is still writing locked the parked and held entries it copies: the release
-- waited for it, and this statement sees the copy.
DELETE FROM oncely_relay_kept AS k
USING oncely_relay_shards AS s
WHERE k.topic = :topic AND k.aggregateid = :aggregateid
  AND s.shard = :shard AND s.owner = :owner AND s.epoch = :epoch
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p
                  WHERE p.topic = k.topic AND p.aggregateid = k.aggregateid AND p.event_id = k.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h
                  WHERE h.topic = k.topic AND h.aggregateid = k.aggregateid AND h.event_id = k.id)

-- name: relay_skipped
-- A skipped row whose key this release just released (never published: `oncely dead skip`),
-- kept as given up so that completeness expects it of no effect; fenced by the shard's epoch,
-- in the release's transaction.
INSERT INTO oncely_relay_skipped (event_id, topic, aggregateid)
SELECT :event_id, :topic, :aggregateid
FROM oncely_relay_shards AS s
WHERE s.shard = :shard AND s.owner = :owner AND s.epoch = :epoch
ON CONFLICT ON CONSTRAINT oncely_relay_skipped_pkey DO NOTHING

-- name: relay_park_failed
-- A release whose own row failed again for good: it stays parked (dead) with the new error.
UPDATE oncely_relay_parked
SET reason = 'dead', error = :error, until = NULL, request = NULL
WHERE topic = :topic AND aggregateid = :aggregateid

-- name: relay_heartbeat
-- This relay is alive (asleep: it waits for a NOTIFY, so staging sends one; exactly_once: its
-- output mode, for status) and extends the leases it still holds (a shard missing from ``kept``
-- was taken over); relays silent for a minute are forgotten. Returns how many relays are alive,
-- which decides each one's fair share of the shards. One statement: an idle relay sends one
-- every third of its lease.
WITH beat AS (
    INSERT INTO oncely_relay_members (relay_id, heartbeat_until, asleep, exactly_once)
    VALUES (:relay_id, now() + make_interval(secs => :ttl_seconds), :asleep, :exactly_once)
    ON CONFLICT (relay_id) DO UPDATE
    SET heartbeat_until = EXCLUDED.heartbeat_until, asleep = EXCLUDED.asleep,
        exactly_once = EXCLUDED.exactly_once
), gone AS (
    DELETE FROM oncely_relay_members
    WHERE heartbeat_until < now() - interval '1 minute' AND relay_id <> :relay_id
), kept AS (
    UPDATE oncely_relay_shards AS s
    SET lease_until = now() + make_interval(secs => :ttl_seconds)
    FROM unnest(CAST(:shards AS smallint[]), CAST(:epochs AS bigint[])) AS p(shard, epoch)
    WHERE s.shard = p.shard AND s.owner = :relay_id AND s.epoch = p.epoch
    RETURNING s.shard
)
SELECT 1 + count(*) AS alive, (SELECT count(*) FROM oncely_relay_shards) AS shards,
       ARRAY(SELECT shard FROM kept) AS kept
FROM oncely_relay_members
WHERE heartbeat_until > now() AND relay_id <> :relay_id

-- name: relay_sleep
-- Ask staging to NOTIFY (asleep: the relay is listening) or stop asking (awake: it polls).
UPDATE oncely_relay_members SET asleep = :asleep WHERE relay_id = :relay_id

-- name: relay_leave
DELETE FROM oncely_relay_members WHERE relay_id = :relay_id

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
WHERE NOT oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
GROUP BY s.shard, o.topic
ORDER BY s.shard, o.topic

-- name: relay_shards
-- Every shard's progress and lease, for status and metrics, with its owner's output mode
-- (NULL: the owner's heartbeats are gone).
SELECT s.shard, s.owner, s.epoch, s.lease_until > now() AS leased, s.lease_until, s.updated_at,
       EXTRACT(EPOCH FROM now() - s.updated_at) AS progress_age_seconds, m.exactly_once
FROM oncely_relay_shards AS s
LEFT JOIN oncely_relay_members AS m ON m.relay_id = s.owner
ORDER BY s.shard

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
-- Parked rows of the :reasons (dead, delayed) with how many rows are held behind them; the
-- row's columns from the outbox, or from oncely_relay_kept once its partition was dropped.
SELECT p.event_id AS id, COALESCE(o.seq, k.seq) AS seq, p.topic, p.aggregateid,
       COALESCE(o.type, k.type) AS type, p.reason, p.error, p.until, p.parked_at,
       p.attempts, p.first_failed_at,
       COALESCE(o.created_at, k.created_at) AS created_at, p.request,
       (SELECT count(*) FROM oncely_relay_held AS h
        WHERE h.topic = p.topic AND h.aggregateid = p.aggregateid) AS held
FROM oncely_relay_parked AS p
LEFT JOIN oncely_outbox AS o ON o.id = p.event_id
LEFT JOIN oncely_relay_kept AS k ON k.id = p.event_id
WHERE p.reason = ANY (CAST(:reasons AS text[]))
  AND (CAST(:topic AS text) IS NULL OR p.topic = :topic)
ORDER BY p.parked_at, 2

-- name: dead_request
-- Ask the relay holding the key's shard to requeue or skip parked rows: the dead rows named
-- by :ids (and of :topic), or all of :topic, or all; a delayed row only when named by its id
-- (requeue: published now; skip: never published).
UPDATE oncely_relay_parked
SET request = :request
WHERE (reason = 'dead' OR (reason = 'delayed' AND CAST(:ids AS uuid[]) IS NOT NULL))
  AND (CAST(:ids AS uuid[]) IS NULL OR event_id = ANY (CAST(:ids AS uuid[])))
  AND (CAST(:topic AS text) IS NULL OR topic = :topic)
RETURNING event_id AS id, topic, aggregateid

-- Retention: the rows of parked keys kept aside when their outbox partition is dropped.

-- name: kept_lock_held
-- Lock the held entries of rows of [:low, :high) against a release (FOR KEY SHARE: a release
-- deletes them, and waits). Before kept_lock_parked, in the order a release deletes them, so
-- the two never wait for each other in a cycle.
SELECT event_id FROM oncely_relay_held
WHERE event_id >= CAST(:low AS uuid) AND event_id < CAST(:high AS uuid)
FOR KEY SHARE

-- name: kept_copy
-- Copy the outbox rows of [:low, :high) that park a key or are held behind one to
-- oncely_relay_kept, locking the parked entries as kept_lock_held the held ones. Run after
-- the relay's progress was read (every row of the range passed: the relay parks a key before
-- its progress passes the row, and holds a row with the progress that passes it), in the
-- transaction that drops the range's partition.
WITH parked AS (
    SELECT event_id FROM oncely_relay_parked
    WHERE event_id >= CAST(:low AS uuid) AND event_id < CAST(:high AS uuid)
    FOR KEY SHARE
), held AS (
    SELECT event_id FROM oncely_relay_held
    WHERE event_id >= CAST(:low AS uuid) AND event_id < CAST(:high AS uuid)
)
INSERT INTO oncely_relay_kept (id, seq, aggregatetype, aggregateid, type, topic, payload,
                               headers, event_key, available_at, created_at, txid, shard,
                               tracingspancontext)
SELECT o.id, o.seq, o.aggregatetype, o.aggregateid, o.type, o.topic, o.payload, o.headers,
       o.event_key, o.available_at, o.created_at, o.txid, o.shard, o.tracingspancontext
FROM oncely_outbox AS o
WHERE o.id >= CAST(:low AS uuid) AND o.id < CAST(:high AS uuid)
  AND o.id IN (SELECT event_id FROM parked UNION SELECT event_id FROM held)

-- Operators' reads: `oncely status`, `oncely verify`, `oncely replay --from-outbox`. None of
-- them writes; the callers run them in READ ONLY transactions.

-- name: ops_parked_by_topic
-- Per topic: keys parked by a dead row and by a delayed row, rows held behind parked keys, dead
-- rows an operator asked to requeue or skip that no relay has carried out yet, and keys parked
-- because the topic is missing: how many rows wait for it (their own and those held behind
-- them) and since when.
SELECT p.topic,
       count(*) FILTER (WHERE p.reason = 'dead') AS dead,
       count(*) FILTER (WHERE p.reason = 'delayed') AS delayed,
       count(*) AS held_keys,
       COALESCE(sum(h.held), 0) AS held_rows,
       count(*) FILTER (WHERE p.request IS NOT NULL) AS requested,
       count(*) FILTER (WHERE p.reason = 'blocked') AS blocked,
       COALESCE(sum(1 + COALESCE(h.held, 0)) FILTER (WHERE p.reason = 'blocked'), 0)
           AS blocked_rows,
       min(p.parked_at) FILTER (WHERE p.reason = 'blocked') AS blocked_since,
       min(p.error) FILTER (WHERE p.reason = 'blocked') AS blocked_error
FROM oncely_relay_parked AS p
LEFT JOIN (SELECT topic, aggregateid, count(*) AS held
           FROM oncely_relay_held
           GROUP BY topic, aggregateid) AS h USING (topic, aggregateid)
GROUP BY p.topic
ORDER BY p.topic

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
           oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq) AS passed,
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
           CASE WHEN NOT oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq) THEN 'unpublished'
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
  AND oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_parked AS p WHERE p.event_id = o.id)
  AND NOT EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id)
ORDER BY o.topic

-- name: republish_summary
-- The outbox rows created in [:since, :until) (of type :type when given), per topic: how many,
-- how many no shard's progress has passed yet (not acknowledged), how many belong to parked
-- keys; with the oldest row the outbox still holds (seq and created_at: rows before it were
-- purged, or never existed), and the lowest seq outside the default partition of a partitioned
-- outbox (retention drops range partitions; default rows stay). One scan of the table.
WITH rows AS (
    SELECT o.topic, o.seq, o.created_at,
           o.tableoid IS DISTINCT FROM to_regclass('oncely_outbox_default')::oid AS ranged,
           o.created_at >= :since
               AND (CAST(:until AS timestamptz) IS NULL OR o.created_at < :until)
               AND (CAST(:type AS text) IS NULL OR o.type = :type) AS in_window,
           oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq) AS passed,
           EXISTS (SELECT 1 FROM oncely_relay_parked AS p
                   WHERE p.topic = o.topic AND p.aggregateid = o.aggregateid) AS parked
    FROM oncely_outbox AS o
    JOIN oncely_relay_shards AS s ON s.shard = o.shard
), first AS (
    SELECT min(seq) AS first_seq, min(created_at) AS first_created_at,
           min(seq) FILTER (WHERE ranged) AS first_ranged_seq
    FROM rows
)
SELECT w.topic, count(w.topic) AS rows, count(*) FILTER (WHERE NOT w.passed) AS unpublished,
       count(*) FILTER (WHERE w.parked) AS parked, f.first_seq, f.first_created_at,
       f.first_ranged_seq
FROM first AS f
LEFT JOIN rows AS w ON w.in_window
GROUP BY w.topic, f.first_seq, f.first_created_at, f.first_ranged_seq
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
SELECT {row_to_publish}, CAST(NULL AS timestamptz) AS available_at
FROM oncely_outbox AS o
WHERE o.created_at >= :since
  AND (CAST(:until AS timestamptz) IS NULL OR o.created_at < :until)
  AND (CAST(:type AS text) IS NULL OR o.type = :type)
ORDER BY o.seq

-- Debezium mode: the outbox purge behind the connector's replication slot.

-- name: debezium_purge_mark
-- A purge mark: the xmin of this statement's snapshot (every transaction id below it had
-- finished when the snapshot was taken) and the WAL insert position read after it. The snapshot
-- is taken before the target list is evaluated, so every transaction older than xmin wrote its
-- commit record before lsn. The insert position, not pg_current_wal_lsn() (the write position),
-- because with synchronous_commit = off a commit may be visible before its record is written.
SELECT CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS xmin,
       CAST(pg_current_wal_insert_lsn() AS text) AS lsn

-- name: debezium_purge_preview
-- Per topic: the outbox rows a purge would delete, and its oldest row. A row qualifies when it
-- was created before the horizon and its row version was written by a transaction older than
-- the mark's xmin (age() compares 32-bit xids modulo 2^31, as PostgreSQL does; a row written
-- by a transaction that was still running at the mark, or after it, does not qualify).
SELECT topic, count(*) AS rows,
       (array_agg(id ORDER BY created_at, seq))[1] AS oldest_id,
       min(created_at) AS oldest_created_at
FROM oncely_outbox
WHERE created_at < now() - make_interval(secs => :older_than)
  AND age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))
GROUP BY topic
ORDER BY topic

-- name: debezium_purge_waiting
-- How many rows older than the horizon the mark does not cover (written by transactions still
-- running at the mark, or later): the purge keeps them.
SELECT count(*) FROM oncely_outbox
WHERE created_at < now() - make_interval(secs => :older_than)
  AND NOT age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))

-- name: debezium_purge
-- Delete one batch of the rows debezium_purge_preview counts: created before the horizon and
-- written by a transaction older than the mark's xmin. The caller deletes only after the
-- connector's slot confirmed the mark's WAL position, so the connector has read every such row
-- (streamed from the WAL, or in the snapshot it took when it started). In Debezium mode nothing
-- settles a row, so the status does not matter. The connector skips DELETEs
-- (skipped.operations), so the purge publishes nothing.
DELETE FROM oncely_outbox
WHERE id IN (
    SELECT id FROM oncely_outbox
    WHERE created_at < now() - make_interval(secs => :older_than)
      AND age(xmin) > age(xid(CAST(:mark_xmin AS xid8)))
    LIMIT :batch_size
)

-- The console's event lookup (oncely.ops.lookup). None of them writes.

-- fragment: lookup_columns
-- An outbox row with where the relay stands with it: its shard's progress passed it or not, the
-- reason its key is parked when it is the parked row, and whether it is held behind one.
SELECT o.id, o.seq, o.shard, o.topic, o.aggregatetype, o.aggregateid, o.type, o.payload,
       CAST(o.headers AS text) AS headers, o.created_at, o.available_at,
       o.tracingspancontext AS trace_context,
       oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq) AS passed,
       p.reason AS parked, p.error AS error,
       EXISTS (SELECT 1 FROM oncely_relay_held AS h WHERE h.event_id = o.id) AS held
FROM oncely_outbox AS o
JOIN oncely_relay_shards AS s ON s.shard = o.shard
LEFT JOIN oncely_relay_parked AS p ON p.event_id = o.id

-- name: lookup_event
-- One outbox row by its id (one probe of the primary key).
{lookup_columns}
WHERE o.id = :id

-- name: lookup_key
-- The newest :limit rows of an aggregate key among the rows whose ids lie in [:low, :high) (a
-- range of the primary key: UUIDv7 ids begin with their moment), newest first.
{lookup_columns}
WHERE o.id >= :low AND o.id < :high AND o.aggregateid = :key
ORDER BY o.seq DESC
LIMIT :limit

-- name: lookup_caused
-- The rows staged by the effects of event :id (their :header, causationId, names it), among
-- the rows whose ids lie in [:low, :high), oldest first.
SELECT o.id, o.type, o.topic, o.aggregateid, o.created_at
FROM oncely_outbox AS o
WHERE o.id >= :low AND o.id < :high AND o.headers ->> :header = :id
ORDER BY o.seq
LIMIT :limit
