-- The operators' audit log (oncely_audit): one row per operation an operator asked for.

-- name: audit_insert
-- Record an operation in the caller's transaction, the one that carried it out.
INSERT INTO oncely_audit (actor, via, action, target, rows, reason)
VALUES (:actor, :via, :action, :target, :rows, :reason)
RETURNING id, at

-- name: audit_list
-- The newest :limit entries (of :action when given), newest first.
SELECT id, at, actor, via, action, target, rows, reason
FROM oncely_audit
WHERE CAST(:action AS text) IS NULL OR action = :action
ORDER BY at DESC, id DESC
LIMIT :limit
