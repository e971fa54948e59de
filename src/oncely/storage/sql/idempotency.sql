-- Inbound idempotency keys. Each statement starts with "-- name: <name>".

-- name: idempotency_insert
-- First sight of (owner, key): claim it. Returns no row when the key is already known.
INSERT INTO oncely_idempotency_keys (owner, key, status, fingerprint, extra)
VALUES (:owner, :key, 'processing', :fingerprint, CAST(:extra AS jsonb))
ON CONFLICT ON CONSTRAINT oncely_idempotency_keys_pkey DO NOTHING
RETURNING received_at

-- name: idempotency_get
-- The existing claim, with its age on the database clock.
SELECT status, fingerprint, detail, result, received_at,
       EXTRACT(EPOCH FROM now() - received_at) AS age_seconds
FROM oncely_idempotency_keys
WHERE owner = :owner AND key = :key

-- name: idempotency_reclaim
-- Take over a rejected or stale claim, only if nobody changed it since we read it: of two
-- concurrent re-claims exactly one updates the row.
UPDATE oncely_idempotency_keys
SET status = 'processing', fingerprint = :fingerprint, extra = CAST(:extra AS jsonb),
    detail = NULL, result = NULL, received_at = now(), finished_at = NULL
WHERE owner = :owner AND key = :key
  AND status = :expected_status AND received_at = :expected_received_at
RETURNING received_at

-- name: idempotency_finish
-- Record the outcome of a claim that is still processing.
UPDATE oncely_idempotency_keys
SET status = :status, detail = :detail, result = CAST(:result AS jsonb), finished_at = now()
WHERE owner = :owner AND key = :key AND status = 'processing'
RETURNING finished_at
