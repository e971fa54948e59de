"""Prometheus metrics of oncely's processes (one registry each, served by :mod:`.http`).

Each process's registry also holds prometheus-client's standard collectors
(:func:`process_registry`): ``process_*`` (CPU seconds, resident and virtual memory, open file
descriptors, start time; Linux only) and ``python_*`` (``python_info``, ``python_gc_*``).
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)


def process_registry() -> CollectorRegistry:
    """A new registry with the standard ``process_*`` and ``python_*`` collectors."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


class RelayMetrics:
    """Counters, gauges and the publish-latency histogram of one relay process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or process_registry()
        r = self.registry
        self.published = Counter(
            "oncely_relay_published", "Records the broker confirmed.", ["topic"], registry=r
        )
        self.produce_errors = Counter(
            "oncely_relay_produce_errors",
            "Failed deliveries (the shard replays from its recorded progress).",
            ["topic", "error"],
            registry=r,
        )
        self.shard_published = Counter(
            "oncely_relay_shard_published",
            "Records the broker confirmed, per shard.",
            ["shard"],
            registry=r,
        )
        self.shard_produce_errors = Counter(
            "oncely_relay_shard_produce_errors",
            "Failed deliveries, per shard.",
            ["shard"],
            registry=r,
        )
        self.dead = Counter(
            "oncely_relay_dead", "Rows dead-lettered (their key parked).", ["topic"], registry=r
        )
        self.lease_lost = Counter(
            "oncely_relay_lease_lost",
            "Shards this relay lost to another before giving them back (found at a heartbeat"
            " or by a refused progress write).",
            registry=r,
        )
        self.progress_refused = Counter(
            "oncely_relay_progress_refused",
            "Progress writes refused because another relay had taken the shard over.",
            registry=r,
        )
        self.publish_latency = Histogram(
            "oncely_relay_publish_latency_seconds",
            "Per page of records: from its oldest row's created_at to the broker's confirmation "
            "of the whole page (observed once per page, not per row).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.shards = Gauge("oncely_relay_shards", "Shards this relay holds.", registry=r)
        self.lease_epoch = Gauge(
            "oncely_relay_lease_epoch", "Lease epoch of each shard held.", ["shard"], registry=r
        )
        self.unpublished = Gauge(
            "oncely_outbox_unpublished_rows",
            "Committed rows not yet acknowledged, per shard.",
            ["shard"],
            registry=r,
        )
        self.lag = Gauge(
            "oncely_outbox_lag_seconds",
            "Age of the oldest unpublished row, per shard (0: none).",
            ["shard"],
            registry=r,
        )
        self.held_keys = Gauge(
            "oncely_relay_held_keys",
            "Parked keys (a dead, delayed or blocked row holds their later rows), per shard.",
            ["shard"],
            registry=r,
        )
        self.blocked_rows = Gauge(
            "oncely_relay_blocked_rows",
            "Rows held because their topic is missing or not authorised, per topic (published "
            "by themselves once it exists).",
            ["topic"],
            registry=r,
        )
        self.shard_replays = Counter(
            "oncely_relay_shard_replays",
            "Times a shard replayed from its recorded progress (a failed or overdue delivery).",
            ["shard"],
            registry=r,
        )
        self.producer_recreations = Counter(
            "oncely_relay_producer_recreations",
            "Producers recreated because they could not go on (fatal error, every broker down).",
            ["reason"],
            registry=r,
        )
        self.transactions = Counter(
            "oncely_relay_transactions",
            "Exactly-once mode (none at least once): Kafka transactions ended, by outcome: "
            "committed; aborted (a record failed or the commit needed an abort: the page "
            "replays); fenced (another producer started with the shard's transactional id); "
            "failed (any other fatal error, or a commit or abort that did not end in time). A "
            "fenced or failed transaction's shard is given up.",
            ["outcome"],
            registry=r,
        )
        self.transaction_seconds = Histogram(
            "oncely_relay_transaction_seconds",
            "Exactly-once mode (no samples at least once): each Kafka transaction's time from "
            "begin_transaction to the end of its commit or abort, whatever its outcome.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.progress_lag = Gauge(
            "oncely_relay_progress_lag_seconds",
            "Exactly-once mode (none at least once), per shard held: how far PostgreSQL's "
            "recorded progress trails the progress committed to Kafka with the pages "
            "(<prefix>.progress): seconds since the oldest commit whose position PostgreSQL has "
            "not recorded yet was reported, 0 when it has recorded every commit. Set every 5 s.",
            ["shard"],
            registry=r,
        )
        self.retention = RetentionMetrics(r)


class RetentionMetrics:
    """The partitioned outbox's and receipts' retention (:mod:`oncely.retention`), as the
    relay sees it at each purge interval; per table (``oncely_outbox``, ``oncely_receipts``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.partitions = Gauge(
            "oncely_retention_partitions",
            "Range partitions of the table (the default one not counted).",
            ["table"],
            registry=r,
        )
        self.bytes = Gauge(
            "oncely_retention_bytes",
            "Size of the table on disk: every partition's table, indexes and TOAST.",
            ["table"],
            registry=r,
        )
        self.oldest = Gauge(
            "oncely_retention_oldest_timestamp_seconds",
            "Start of the table's oldest retained partition, Unix seconds.",
            ["table"],
            registry=r,
        )
        self.default_rows = Gauge(
            "oncely_retention_default_rows",
            "Rows in the table's default partition (PostgreSQL's live-row statistics, a few "
            "seconds behind): no range partition held them when they were written.",
            ["table"],
            registry=r,
        )
        self.blocked = Gauge(
            "oncely_retention_blocked_seconds",
            "How long the table's oldest partition has been past its horizon and still kept "
            "(0: none is); `oncely retention plan` says what it waits for.",
            ["table"],
            registry=r,
        )
        self.kept = Gauge(
            "oncely_retention_kept_partitions",
            "Partitions past their horizon that the guard kept in the last run.",
            ["table"],
            registry=r,
        )
        self.dropped = Counter(
            "oncely_retention_dropped_partitions",
            "Partitions dropped by retention.",
            ["table"],
            registry=r,
        )
        self.errors = Counter(
            "oncely_retention_errors",
            "Retention runs that failed (the database or Kafka did not answer), and partitions "
            "that could not be created ahead.",
            registry=r,
        )


class ConsumerMetrics:
    """Counters, gauges and the handler-latency histogram of one consumer process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or process_registry()
        r = self.registry
        self.consumed = Counter(
            "oncely_consumer_consumed", "Records received.", ["effect"], registry=r
        )
        self.applied = Counter(
            "oncely_consumer_applied", "Effects applied (receipt inserted).", ["effect"], registry=r
        )
        self.duplicates = Counter(
            "oncely_consumer_duplicates_suppressed",
            "Records whose receipt already existed: the handler was not called.",
            ["effect"],
            registry=r,
        )
        self.failures = Counter(
            "oncely_consumer_handler_failures", "Handler failures.", ["effect"], registry=r
        )
        self.dead_lettered = Counter(
            "oncely_consumer_dead_lettered",
            "Records produced to the effect's DLQ topic.",
            ["effect", "reason"],
            registry=r,
        )
        self.blocked = Gauge(
            "oncely_consumer_blocked_partitions",
            "Partitions stopped by the block policy.",
            ["effect"],
            registry=r,
        )
        self.rejoins = Counter(
            "oncely_consumer_rejoins",
            "Kafka clients recreated because they stayed out of their group past"
            " ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS.",
            ["effect"],
            registry=r,
        )
        self.lag = Gauge(
            "oncely_consumer_lag_records",
            "Records the consumer has yet to read: the partition's high watermark minus the"
            " consumer's position.",
            ["effect", "topic", "partition"],
            registry=r,
        )
        self.missing_events = Gauge(
            "oncely_effect_missing_events",
            "Published events of the effect's types older than ONCELY_COMPLETENESS_GRACE_SECONDS"
            " with neither its receipt nor a dead letter, at the last completeness check.",
            ["effect"],
            registry=r,
        )
        self.completeness_seconds = Gauge(
            "oncely_effect_completeness_check_seconds",
            "How long the last completeness check of the effect took, in seconds.",
            ["effect"],
            registry=r,
        )
        self.handler_latency = Histogram(
            "oncely_consumer_handler_seconds",
            "Handler run time per applied batch (all of its new events), in seconds.",
            ["effect"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=r,
        )


class TaskMetrics:
    """Counters of one task worker process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or process_registry()
        r = self.registry
        self.attempts = Counter(
            "oncely_tasks_attempts",
            "Attempts run, by task name and outcome (completed, retry, dead, lease_lost).",
            ["name", "outcome"],
            registry=r,
        )
        self.swept = Counter(
            "oncely_tasks_swept",
            "Tasks the sweep settled (TTL passed or lease expired), by outcome.",
            ["outcome"],
            registry=r,
        )
        self.purged = Counter(
            "oncely_tasks_purged", "Finished tasks deleted after the retention.", registry=r
        )
