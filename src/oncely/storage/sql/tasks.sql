-- Durable local tasks over oncely_tasks. Each starts with "-- name: <name>".
--
-- States: queued -> leased -> completed | queued (retry) | dead; an expired lease moves a
-- retry_safe task back to queued (or failed after max_attempts) and an irreversible one to
-- stale, which only an operator's reclaim moves on; a task past expires_at becomes expired.
-- Every time is the database clock. "attempts" is the fencing token: a lease increments it,
-- and every settle must present the attempt, the owner and an unexpired lease. A statement
-- whose rows become a Task or a TaskFailure names its columns after their fields.

-- name: task_names_waiting
-- Names of the tasks a worker may have to run: the start-up check wants a handler for each.
SELECT DISTINCT name FROM oncely_tasks
WHERE status = ANY (ARRAY['queued'::text, 'leased'::text])
ORDER BY name

-- name: task_lease
-- Lease the oldest due queued task this worker has a handler for. SKIP LOCKED lets workers
-- lease side by side; a task past its TTL is left to the sweep (it expires, never runs).
WITH due AS (
    SELECT id FROM oncely_tasks
    WHERE status = 'queued'
      AND available_at <= now()
      AND (expires_at IS NULL OR expires_at > now())
      AND name = ANY (CAST(:names AS text[]))
    ORDER BY available_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE oncely_tasks AS t
SET status = 'leased', attempts = t.attempts + 1, lease_owner = :owner,
    lease_until = now() + make_interval(secs => :lease_seconds)
FROM due
WHERE t.id = due.id
RETURNING t.id, t.task_key, t.name, t.payload, t.policy, t.attempts AS attempt, t.max_attempts,
          t.lease_owner, t.lease_until, t.expires_at, t.tracingspancontext AS trace_context

-- name: task_lease_by_key
-- Lease one task by its key (a durable command's immediate delivery, right after its commit).
-- If a worker leased it first, its row lock makes this wait and then find it leased: no row.
UPDATE oncely_tasks
SET status = 'leased', attempts = attempts + 1, lease_owner = :owner,
    lease_until = now() + make_interval(secs => :lease_seconds)
WHERE task_key = :task_key
  AND status = 'queued'
  AND available_at <= now()
  AND (expires_at IS NULL OR expires_at > now())
RETURNING id, task_key, name, payload, policy, attempts AS attempt, max_attempts, lease_owner,
          lease_until, expires_at, tracingspancontext AS trace_context

-- name: task_complete
-- Settle a successful attempt, fenced: only the current owner of this attempt, while its lease
-- runs. No row means the lease was lost (expired, swept, or re-leased): the caller raises.
UPDATE oncely_tasks
SET status = 'completed', finished_at = now(), lease_owner = NULL, lease_until = NULL
WHERE id = :id AND status = 'leased' AND attempts = :attempt AND lease_owner = :owner
  AND lease_until > now()
RETURNING finished_at

-- name: task_retry
-- Settle a failed attempt that will be retried after :delay_seconds, with the same fence.
UPDATE oncely_tasks
SET status = 'queued', available_at = now() + make_interval(secs => :delay_seconds),
    last_error = :error, lease_owner = NULL, lease_until = NULL
WHERE id = :id AND status = 'leased' AND attempts = :attempt AND lease_owner = :owner
  AND lease_until > now()
RETURNING available_at

-- name: task_dead
-- Settle a failed last attempt (attempts reached max_attempts): dead, with the same fence.
UPDATE oncely_tasks
SET status = 'dead', finished_at = now(), last_error = :error, lease_owner = NULL,
    lease_until = NULL
WHERE id = :id AND status = 'leased' AND attempts = :attempt AND lease_owner = :owner
  AND lease_until > now()
RETURNING finished_at

-- name: task_renew
-- Extend the lease of an irreversible task while its handler works (the lease doubles as the
-- worker's heartbeat), with the same fence: a worker never renews another's lease, nor one
-- that already ran out. Retry-safe tasks never renew: their expiry means "run it again".
UPDATE oncely_tasks
SET lease_until = now() + make_interval(secs => :lease_seconds)
WHERE id = :id AND status = 'leased' AND attempts = :attempt AND lease_owner = :owner
  AND lease_until > now() AND policy = 'irreversible'
RETURNING lease_until

-- name: task_expire_queued
-- Sweep, first part: queued tasks past their TTL expire (they never run).
WITH due AS (
    SELECT id FROM oncely_tasks
    WHERE status = 'queued' AND expires_at <= now()
    ORDER BY expires_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
UPDATE oncely_tasks AS t
SET status = 'expired', finished_at = now(),
    last_error = 'the TTL passed before the task ran (' || t.attempts || ' attempts)'
FROM due
WHERE t.id = due.id
RETURNING t.id AS task_id, t.task_key, t.name, t.attempts AS attempt, t.status AS outcome,
          t.last_error AS error

-- name: task_lapsed_leases
-- Sweep, second part: leases that ran out, locked until this sweep's transaction ends so each
-- is settled once; the caller decides each outcome and applies it with task_settle_lapsed.
SELECT id AS task_id, task_key, name, policy, attempts AS attempt, max_attempts, lease_owner,
       coalesce(expires_at <= now(), false) AS past_ttl
FROM oncely_tasks
WHERE status = 'leased' AND lease_until <= now()
ORDER BY lease_until
LIMIT :batch
FOR UPDATE SKIP LOCKED

-- name: task_settle_lapsed
-- Move a task whose lease ran out to :status (queued, stale, failed or expired), fenced by the
-- attempt that lapsed. A re-queued task is due at once; terminal ones get finished_at.
UPDATE oncely_tasks
SET status = :status, last_error = :reason, lease_owner = NULL, lease_until = NULL,
    finished_at = CASE WHEN CAST(:finished AS boolean) THEN now() END
WHERE id = :id AND status = 'leased' AND attempts = :attempt AND lease_until <= now()
RETURNING status

-- name: task_purge
-- Delete one batch of terminal tasks finished more than :retention_seconds ago.
WITH doomed AS (
    SELECT id FROM oncely_tasks
    WHERE status = ANY (ARRAY['completed'::text, 'dead'::text, 'failed'::text, 'expired'::text])
      AND finished_at < now() - make_interval(secs => :retention_seconds)
    ORDER BY finished_at
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
)
DELETE FROM oncely_tasks AS t
USING doomed
WHERE t.id = doomed.id
RETURNING t.id

-- name: task_reclaim
-- An operator's decision: run a stale (or dead, or failed) task again, due now. Attempts are
-- kept, so a reclaimed task that fails again goes dead at once; last_error stays as history.
-- The NOTIFY wakes idle workers, as an insert would.
WITH reclaimed AS (
    UPDATE oncely_tasks
    SET status = 'queued', available_at = now(), finished_at = NULL
    WHERE id = :id AND status = ANY (ARRAY['stale'::text, 'dead'::text, 'failed'::text])
    RETURNING *
)
SELECT reclaimed.*
FROM reclaimed CROSS JOIN LATERAL (SELECT pg_notify('oncely_tasks', '')) AS wake

-- name: task_get
-- One task by id.
SELECT * FROM oncely_tasks WHERE id = :id

-- name: task_list
-- The most recent tasks, optionally in one state, newest first.
SELECT * FROM oncely_tasks
WHERE CAST(:status AS text) IS NULL OR status = :status
ORDER BY created_at DESC, id
LIMIT :limit

-- name: ops_tasks_by_status
-- How many tasks are in each status (`oncely status`).
SELECT status, count(*) AS tasks
FROM oncely_tasks
GROUP BY status

-- name: lookup_tasks
-- The tasks effects queued for one event: their default key is <effect>:<event id>:<name>
-- (the console's event lookup; the tasks table is scanned: it keeps finished tasks only for
-- the worker's retention period).
SELECT * FROM oncely_tasks
WHERE task_key LIKE '%:' || :id || ':%'
ORDER BY created_at
LIMIT :limit
