"""Typed settings read from ``ONCELY_*`` environment variables (pydantic-settings).

Each group has its own prefix, so ``ONCELY_KAFKA_BOOTSTRAP_SERVERS`` sets
``KafkaSettings.bootstrap_servers`` and ``ONCELY_DATABASE_URL`` sets ``DatabaseSettings.url``.
Raw librdkafka options go through ``ONCELY_KAFKA_EXTRA`` as a JSON object.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """How to reach Kafka."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_KAFKA_", extra="ignore")

    bootstrap_servers: str = Field(
        default="127.0.0.1:9092", description="Comma-separated host:port list of brokers."
    )
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="Raw librdkafka settings (SASL, TLS, ...) merged into every client's config.",
    )

    def client_config(self) -> dict[str, str | int | float | bool]:
        """The librdkafka configuration shared by every client oncely creates."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.extra}


class DatabaseSettings(BaseSettings):
    """How to reach PostgreSQL."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_DATABASE_", extra="ignore")

    url: SecretStr = Field(
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user:password@host:5432/db."
    )


class RelaySettings(BaseSettings):
    """How the relay claims, publishes and settles outbox rows (``ONCELY_RELAY_*``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_RELAY_", extra="ignore")

    relay_id: str | None = Field(
        default=None, description="This relay's lease owner id (default: hostname-pid-random)."
    )
    batch_size: int = Field(default=500, ge=1, le=10_000, description="Rows claimed at once.")
    lease_seconds: float = Field(
        default=30.0, gt=0, description="How long a claim holds rows before another relay may."
    )
    max_attempts: int = Field(
        default=10, ge=1, description="Failed deliveries before a row is dead (broker errors)."
    )
    backoff_base_seconds: float = Field(default=1.0, gt=0, description="First retry delay.")
    backoff_max_seconds: float = Field(default=300.0, gt=0, description="Longest retry delay.")
    poll_interval_seconds: float = Field(
        default=1.0, gt=0, description="Idle wait between claims when no NOTIFY arrives."
    )
    max_in_flight: int = Field(
        default=2000, ge=1, description="Records produced but not yet confirmed, at most."
    )
    linger_ms: int = Field(default=5, ge=0, description="librdkafka linger.ms.")
    compression: str = Field(default="lz4", description="librdkafka compression.type.")
    delivery_timeout_ms: int = Field(
        default=30_000, ge=1000, description="librdkafka message.timeout.ms: a report's deadline."
    )
    retention_seconds: float = Field(
        default=7 * 24 * 3600.0, ge=0, description="Keep published rows this long (0: delete)."
    )
    purge_interval_seconds: float = Field(
        default=600.0, gt=0, description="How often the relay purges published rows."
    )
    metrics_port: int | None = Field(
        default=None, description="Serve /metrics, /healthz and /readyz on this port."
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Bound on the graceful drain after SIGTERM."
    )


class TopicSettings(BaseSettings):
    """How ``oncely topics ensure`` creates topics (``ONCELY_TOPICS_*``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_TOPICS_", extra="ignore")

    partitions: int = Field(default=6, ge=1, description="Partitions of each new topic.")
    replication_factor: int = Field(default=1, ge=1, description="Replicas of each partition.")
    min_insync_replicas: int = Field(
        default=1, ge=1, description="min.insync.replicas: acks=all waits for this many."
    )


class ConsumerSettings(BaseSettings):
    """How effect consumers poll and apply (``ONCELY_CONSUMER_*``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_CONSUMER_", extra="ignore")

    batch_size: int = Field(default=500, ge=1, description="Records applied per transaction.")
    poll_timeout_seconds: float = Field(default=0.5, gt=0, description="Wait for records.")
    metrics_port: int | None = Field(
        default=None, description="Serve /metrics, /healthz and /readyz on this port."
    )
    session_timeout_ms: int = Field(default=45_000, description="librdkafka session.timeout.ms.")
