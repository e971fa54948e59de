-- Retention's marks of Kafka's high watermarks (oncely.retention). Each statement starts with
-- "-- name: <name>".

-- name: retention_marks_of
-- A receipts partition's mark: one row per (topic, partition), partition -1 for a topic that
-- did not exist when the mark was taken. No row: no mark.
SELECT topic, partition, high, receipted
FROM oncely_retention_marks
WHERE receipts_partition = :receipts_partition
ORDER BY topic, partition

-- name: retention_mark_insert
-- One (topic, partition) of a receipts partition's mark.
INSERT INTO oncely_retention_marks (receipts_partition, topic, partition, high, receipted)
VALUES (:receipts_partition, :topic, :partition, :high, :receipted)

-- name: retention_marks_discard
-- Forget a receipts partition's mark (it is dropped, or the outbox holds its events again).
DELETE FROM oncely_retention_marks WHERE receipts_partition = :receipts_partition
