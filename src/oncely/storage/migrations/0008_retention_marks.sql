-- oncely 0008: retention's marks of Kafka's high watermarks, one set per receipts partition.
-- Runs inside one transaction with search_path set to the target schema.
--
-- When a receipts partition first becomes otherwise droppable (its range past the horizon, the
-- outbox holding none of its events), `oncely retention run` records, for each topic its
-- receipts name, every partition's high watermark at that moment, and the highest offset
-- receipted there. Every copy of the partition's events that Kafka held then (a republish, a
-- relay's duplicate, on any partition of the topic) lies below the mark, so the partition is
-- dropped only once each marked partition's log start has reached its mark (or the topic is
-- deleted). A row with partition -1 says the topic did not exist when the mark was taken. The
-- marks go with their partition; they are discarded when the outbox holds its events again.
CREATE TABLE oncely_retention_marks (
    receipts_partition text NOT NULL,
    topic text NOT NULL,
    partition integer NOT NULL,
    high bigint NOT NULL,
    receipted bigint,
    marked_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_retention_marks_pkey PRIMARY KEY (receipts_partition, topic, partition),
    CONSTRAINT oncely_retention_marks_partition_check CHECK (partition >= -1)
);
