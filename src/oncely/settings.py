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

    def client_config(self) -> dict[str, str]:
        """The librdkafka configuration shared by every client oncely creates."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.extra}


class DatabaseSettings(BaseSettings):
    """How to reach PostgreSQL."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_DATABASE_", extra="ignore")

    url: SecretStr = Field(
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user:password@host:5432/db."
    )
