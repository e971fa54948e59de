"""Prometheus metrics of the relay (one registry per process, served by :mod:`oncely.ops.http`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RelayMetrics:
    """Counters, gauges and the publish-latency histogram of one relay process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.claimed = Counter("oncely_relay_claimed", "Rows claimed.", ["topic"], registry=r)
        self.published = Counter(
            "oncely_relay_published", "Rows published and settled.", ["topic"], registry=r
        )
        self.retries = Counter(
            "oncely_relay_retries", "Failed deliveries scheduled for retry.", ["topic"], registry=r
        )
        self.dead = Counter("oncely_relay_dead", "Rows that went dead.", ["topic"], registry=r)
        self.lease_lost = Counter(
            "oncely_relay_lease_lost",
            "Settles refused because another relay had re-claimed the row.",
            registry=r,
        )
        self.publish_latency = Histogram(
            "oncely_relay_publish_latency_seconds",
            "From the row's created_at to the broker's confirmation.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.backlog = Gauge(
            "oncely_outbox_backlog_rows", "Pending rows per topic.", ["topic"], registry=r
        )
        self.oldest_pending = Gauge(
            "oncely_outbox_oldest_pending_seconds",
            "Age of the oldest pending row per topic.",
            ["topic"],
            registry=r,
        )
        self.dead_rows = Gauge(
            "oncely_outbox_dead_rows", "Dead rows per topic.", ["topic"], registry=r
        )
