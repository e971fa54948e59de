"""Typed settings read from ``ONCELY_*`` environment variables (pydantic-settings).

Each group has its own prefix, so ``ONCELY_KAFKA_BOOTSTRAP_SERVERS`` sets
``KafkaSettings.bootstrap_servers``; the commands read the database URL from
``ONCELY_DATABASE_URL`` (``--database-url``).
Raw librdkafka options go through ``ONCELY_KAFKA_EXTRA`` as a JSON object.

Secrets (``ONCELY_KAFKA_SASL_PASSWORD``, ``ONCELY_DATABASE_URL``, secret-looking keys of
``ONCELY_KAFKA_EXTRA``) never appear in a settings object's ``repr`` nor in its validation
errors; only :meth:`KafkaSettings.client_config` reveals them, to hand them to librdkafka.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from oncely.errors import ConfigurationError

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]
ClientValue = str | int | float | bool
ClientConfig = dict[str, Any]
"""A confluent-kafka client configuration: librdkafka settings, and the ``logger``."""


class _LibrdkafkaLine(logging.Filter):
    """Turn confluent-kafka's ``log("%s [%s] %s", facility, client, text)`` calls into a record
    whose message is librdkafka's text, with ``facility`` and ``client`` as fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 3:
            record.facility, record.client, record.msg = record.args
            record.args = ()
        return True


KAFKA_LOGGER = logging.getLogger("oncely.kafka")
"""The logger of librdkafka's own lines from every client oncely creates (their ``logger``
option): records at librdkafka's level, with ``client`` (e.g. ``rdkafka#producer-1``) and
``facility`` fields. They reach the handlers the process configured, or none: never Python's
last-resort stderr handler."""
KAFKA_LOGGER.addFilter(_LibrdkafkaLine())
KAFKA_LOGGER.addHandler(logging.NullHandler())

#: librdkafka keys whose values are secrets: masked wherever oncely shows a configuration.
SECRET_KEY = re.compile(r"password|secret|token|key\.pem|oauthbearer\.config|jaas", re.IGNORECASE)
_MASK = "**********"
# Typed field -> the librdkafka key it sets (ONCELY_KAFKA_EXTRA must not set it as well).
_TYPED_KEYS = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "ssl_ca_location": "ssl.ca.location",
}
_ALIASES = {"sasl.mechanisms": "sasl.mechanism"}
# SchemaSettings field -> the SchemaRegistryClient configuration key it sets.
_REGISTRY_TLS_KEYS = {
    "schema_registry_ssl_ca_location": "ssl.ca.location",
    "schema_registry_ssl_certificate_location": "ssl.certificate.location",
    "schema_registry_ssl_key_location": "ssl.key.location",
}

#: A CloudEvents ``source``: a URI-reference, written here as visible ASCII without spaces.
CLOUDEVENTS_SOURCE_PATTERN = r"^[!-~]+$"


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the values of secret-looking keys (see :data:`SECRET_KEY`) masked."""
    return {key: _MASK if SECRET_KEY.search(key) else value for key, value in config.items()}


logger = logging.getLogger(__name__)


def _deprecation(prefix: str, old: str, new: str) -> str:
    return (
        f"the setting {old} ({prefix}{old.upper()}, --{old.replace('_', '-')}) is deprecated and"
        f" will be removed: use {new} ({prefix}{new.upper()}, --{new.replace('_', '-')})"
    )


class _OldNames(PydanticBaseSettingsSource):
    """The ``ONCELY_*`` variables of a group's renamed settings, under their new names (so the
    new variable wins when both are set)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads the variables itself

    def __call__(self) -> dict[str, Any]:
        settings_cls: type[RenamableSettings] = self.settings_cls  # type: ignore[assignment]
        prefix = str(self.config.get("env_prefix", "")).upper()
        found: dict[str, Any] = {}
        for old, new in settings_cls.renamed.items():
            value = os.environ.get(prefix + old.upper())
            if value is not None:
                logger.warning(_deprecation(prefix, old, new))
                found[new] = value
        return found


class RenamableSettings(BaseSettings):
    """A settings group whose renamed settings still work under their old names (``renamed``:
    old name -> new name), as ``ONCELY_*`` variables, keyword arguments or command-line options,
    each with a one-line deprecation warning on the ``oncely.settings`` logger. Precedence is
    unchanged: a keyword argument (an option) over a variable, and the new variable over the old.
    """

    renamed: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def renamed_variables(cls) -> dict[str, str]:
        """Each old ``ONCELY_*`` variable still read -> the variable that replaces it."""
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        return {prefix + old.upper(): prefix + new.upper() for old, new in cls.renamed.items()}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _OldNames(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    @model_validator(mode="before")
    @classmethod
    def _old_keywords(cls, data: Any) -> Any:
        if isinstance(data, dict):
            prefix = str(cls.model_config.get("env_prefix", ""))
            for old, new in cls.renamed.items():
                if old in data:
                    logger.warning(_deprecation(prefix, old, new))
                    data[new] = data.pop(old)
        return data


class KafkaSettings(BaseSettings):
    """How to reach Kafka, including authentication (SASL) and encryption (TLS).

    The typed security fields cover the usual cases; any other librdkafka setting goes in
    ``extra``. Setting one librdkafka key both ways is refused (it would be ambiguous which
    wins). Raises ``pydantic.ValidationError`` (without echoing any value) when SASL
    credentials are half given, or given for a protocol that does not use them.
    """

    model_config = SettingsConfigDict(
        env_prefix="ONCELY_KAFKA_", extra="ignore", hide_input_in_errors=True
    )

    bootstrap_servers: str = Field(
        default="127.0.0.1:9092", description="Comma-separated host:port list of brokers."
    )
    security_protocol: SecurityProtocol | None = Field(
        default=None,
        description="librdkafka security.protocol: PLAINTEXT (default), SSL, SASL_PLAINTEXT "
        "or SASL_SSL.",
    )
    sasl_mechanism: SaslMechanism | None = Field(
        default=None, description="librdkafka sasl.mechanism, e.g. SCRAM-SHA-512 or PLAIN."
    )
    sasl_username: str | None = Field(default=None, description="librdkafka sasl.username.")
    sasl_password: SecretStr | None = Field(
        default=None, description="librdkafka sasl.password (never logged or printed)."
    )
    ssl_ca_location: str | None = Field(
        default=None,
        description="librdkafka ssl.ca.location: PEM file of the CA that signed the brokers' "
        "certificates (default: the system's trust store).",
    )
    extra: dict[str, ClientValue] = Field(
        default_factory=dict,
        repr=False,
        description="Raw librdkafka settings merged into every client's config (JSON object).",
    )

    @model_validator(mode="after")
    def _check_security(self) -> KafkaSettings:
        extra = {_ALIASES.get(key, key): key for key in self.extra}
        for field_name, key in _TYPED_KEYS.items():
            if getattr(self, field_name) is not None and key in extra:
                raise ValueError(
                    f"ONCELY_KAFKA_EXTRA sets {extra[key]!r} and ONCELY_KAFKA_"
                    f"{field_name.upper()} sets it too: set it in one place"
                )
        if (self.sasl_username is None) != (self.sasl_password is None):
            raise ValueError(
                "set both ONCELY_KAFKA_SASL_USERNAME and ONCELY_KAFKA_SASL_PASSWORD, or neither"
            )
        protocol = self.security_protocol or str(self.extra.get("security.protocol", ""))
        if self.sasl_username is not None and not protocol.upper().startswith("SASL_"):
            raise ValueError(
                "SASL credentials are set but the security protocol is "
                f"{protocol or 'PLAINTEXT (the default)'}: set ONCELY_KAFKA_SECURITY_PROTOCOL "
                "to SASL_SSL or SASL_PLAINTEXT"
            )
        return self

    def __repr_args__(self) -> Any:
        yield from super().__repr_args__()
        yield "extra", redact_config(self.extra)

    def client_config(self) -> ClientConfig:
        """The librdkafka configuration shared by every client oncely creates.

        It holds the secrets in clear text (librdkafka needs them): never log it; use
        :func:`redact_config` to show it. librdkafka's log lines go to :data:`KAFKA_LOGGER`,
        delivered when the client is polled.
        """
        config: ClientConfig = {
            "bootstrap.servers": self.bootstrap_servers,
            "logger": KAFKA_LOGGER,
        }
        for field_name, key in _TYPED_KEYS.items():
            value = getattr(self, field_name)
            if isinstance(value, SecretStr):
                config[key] = value.get_secret_value()
            elif value is not None:
                config[key] = value
        return {**config, **self.extra}


class RelaySettings(RenamableSettings):
    """How the relay reads, publishes and records outbox rows (``ONCELY_RELAY_*``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_RELAY_", extra="ignore")
    renamed: ClassVar[Mapping[str, str]] = {
        "relay_id": "owner_id",
        "backoff_base_seconds": "initial_backoff_seconds",
        "backoff_max_seconds": "max_backoff_seconds",
    }

    owner_id: str | None = Field(
        default=None,
        description="This relay's id as the owner of its shard leases (default: "
        "hostname-pid-random; two relays must never share one).",
    )
    batch_size: int = Field(
        default=1000,
        ge=1,
        le=10_000,
        description="Rows read per page; a large backlog doubles it per full page, up to half "
        "of max_in_flight.",
    )
    lease_seconds: float = Field(
        default=6.0,
        gt=0,
        description="Shard lease, renewed every third of it; another relay takes a shard over "
        "this long after its holder died. A relay's transaction left idle this long (the "
        "process paused) is ended by the server, so its locks cannot keep the shards.",
    )
    max_attempts: int = Field(
        default=10, ge=1, description="Failed deliveries before a row is dead (broker errors)."
    )
    initial_backoff_seconds: float = Field(
        default=1.0, gt=0, description="First retry delay (then doubling)."
    )
    max_backoff_seconds: float = Field(default=300.0, gt=0, description="Longest retry delay.")
    poll_interval_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Longest wait of a quiet relay for a NOTIFY before it reads anyway (a "
        "writer whose REPEATABLE READ snapshot predates the relay's going quiet sends none).",
    )
    max_in_flight: int = Field(
        default=10_000, ge=1, description="Records produced but not yet confirmed, at most."
    )
    linger_ms: int | None = Field(
        default=None,
        ge=0,
        description="librdkafka linger.ms. Default: 5 ms while the relay polls (rows flow fast"
        " and batch), and a quiet relay (waiting for NOTIFYs) sends each read's records at once;"
        " a value given here holds in both modes.",
    )
    compression: str = Field(default="lz4", description="librdkafka compression.type.")
    delivery_timeout_ms: int = Field(
        default=30_000,
        ge=1000,
        description="How long the relay waits for a page's delivery reports before it asks "
        "again whether the topic exists (a shard whose topic is gone replays; the others wait "
        "on) and, with every broker down, recreates the producer and replays "
        "(librdkafka's own message.timeout.ms is infinite).",
    )
    retention_seconds: float = Field(
        default=7 * 24 * 3600.0,
        ge=0,
        description="Keep published rows this long (0: purge them at every purge interval); on "
        "partitioned tables, an outbox partition stays until its range ended this long ago (the "
        "republish horizon).",
    )
    purge_interval_seconds: float = Field(
        default=600.0,
        gt=0,
        description="How often the relay purges published rows, off its loop (on partitioned "
        "tables: runs retention, see ONCELY_RETENTION_IN_RELAY).",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /metrics, /healthz and /readyz on this port.",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0, description="Bound on the graceful drain after SIGTERM."
    )
    exactly_once: bool = Field(
        default=False,
        description="Publish each page in a Kafka transaction with its shard's progress, on a "
        "producer per shard whose transactional id follows the lease: a crashed, paused or "
        "replaced relay puts no duplicate record before read_committed consumers (docs: "
        "concepts, exactly-once output). Needs the progress topic (oncely topics ensure).",
    )
    transactional_id_prefix: str = Field(
        default="oncely-relay",
        min_length=1,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Exactly-once mode: shard n's transactional id is <prefix>-<n> and the "
        "progress topic <prefix>.progress; one prefix per outbox sharing a Kafka cluster.",
    )
    cloudevents_source: str | None = Field(
        default=None,
        pattern=CLOUDEVENTS_SOURCE_PATTERN,
        description="Add the CloudEvents binary-mode headers (ce_id, ce_type, ce_time, "
        "ce_source, ce_specversion) to every record, with this ce_source (a URI-reference such "
        "as /shop/orders); `oncely debezium config --cloudevents-source` makes Debezium send "
        "the same.",
    )


class RetentionSettings(BaseSettings):
    """How partitions of the partitioned outbox and receipts are kept, created and dropped
    (``ONCELY_RETENTION_*``; see :mod:`oncely.retention`). The outbox's horizon is the relay's
    ``retention_seconds`` (``ONCELY_RELAY_RETENTION_SECONDS``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_RETENTION_", extra="ignore")

    receipts_horizon_seconds: float = Field(
        default=21 * 24 * 3600.0,
        ge=0,
        description="Keep a receipts partition until its range ended this long ago (and until "
        "Kafka has deleted every record of its topics below the high watermarks marked once the "
        "outbox let its events go): at least the outbox's retention plus the topics' "
        "retention.ms plus their segment.ms (Kafka deletes whole segments), and above every "
        "other service's republish horizon for these events.",
    )
    ahead: int = Field(
        default=3, ge=0, le=1000, description="Partitions created ahead of the current one."
    )
    lock_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description="How long a partition's drop or creation waits for its locks before it "
        "gives up until the next run (staging waits behind it that long at most).",
    )
    kafka_timeout_seconds: float = Field(
        default=15.0,
        gt=0,
        description="How long retention waits for Kafka's topic metadata and watermarks.",
    )
    in_relay: bool = Field(
        default=True,
        description="The relay drops partitions on its purge timer; false: it only plans (for "
        "its retention metrics) and `oncely retention run --execute` (a Job) drops them.",
    )
    run_interval_seconds: float | None = Field(
        default=None,
        gt=0,
        description="How long `oncely retention run --execute` runs are apart at most (a Job's "
        "schedule plus its starting deadline): the run refuses when ONCELY_RETENTION_AHEAD "
        "partitions do not outlast it. Unset: not checked. (The relay checks against "
        "ONCELY_RELAY_PURGE_INTERVAL_SECONDS.)",
    )


class TopicLayout(NamedTuple):
    """The declared shape of one topic."""

    partitions: int
    replication_factor: int
    min_insync_replicas: int


class TopicOverride(BaseModel):
    """What one event type's topics declare differently from the global ``ONCELY_TOPICS_*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partitions: int | None = Field(default=None, ge=1)
    replication_factor: int | None = Field(default=None, ge=1)
    min_insync_replicas: int | None = Field(default=None, ge=1)


class TopicSettings(BaseSettings):
    """How ``oncely topics ensure`` creates topics (``ONCELY_TOPICS_*``).

    The global values apply to every event type's topic unless
    ``overrides`` names the event type, e.g. ``ONCELY_TOPICS_OVERRIDES='{"transfer.completed":
    {"partitions": 24}}'``; a key left out keeps the global value. The defaults suit one
    development broker: production declares ``replication_factor`` 3 and
    ``min_insync_replicas`` 2. Raises ``pydantic.ValidationError`` when any topic would have
    ``min_insync_replicas`` above its ``replication_factor`` (no ``acks=all`` write could
    ever succeed).
    """

    model_config = SettingsConfigDict(env_prefix="ONCELY_TOPICS_", extra="ignore")

    partitions: int = Field(default=6, ge=1, description="Partitions of each new topic.")
    replication_factor: int = Field(default=1, ge=1, description="Replicas of each partition.")
    min_insync_replicas: int = Field(
        default=1, ge=1, description="min.insync.replicas: acks=all waits for this many."
    )
    overrides: dict[str, TopicOverride] = Field(
        default_factory=dict,
        description="Per event type name: {partitions, replication_factor, "
        "min_insync_replicas}, each optional (JSON object).",
    )

    @model_validator(mode="after")
    def _check_replicas(self) -> TopicSettings:
        for name in ["", *self.overrides]:
            layout = self.layout(name)
            if layout.min_insync_replicas > layout.replication_factor:
                where = f"event type {name!r}" if name else "ONCELY_TOPICS_*"
                raise ValueError(
                    f"{where}: min_insync_replicas {layout.min_insync_replicas} exceeds "
                    f"replication_factor {layout.replication_factor}: no write could succeed"
                )
        return self

    def layout(self, event_type: str) -> TopicLayout:
        """The declared layout of ``event_type``'s topics: its override over the globals."""
        override = self.overrides.get(event_type, TopicOverride())
        return TopicLayout(
            override.partitions or self.partitions,
            override.replication_factor or self.replication_factor,
            override.min_insync_replicas or self.min_insync_replicas,
        )


class SchemaSettings(BaseSettings):
    """Where events' schemas are found: the committed catalog and the schema registry
    (``ONCELY_*``).

    Read by ``oncely consume`` (its ``--schemas-dir`` and ``--schema-registry-url`` options
    override them), ``oncely schemas register|check``, :func:`oncely.schemas.loader.codec_for`
    and ``run_consumers`` / ``build_consumers`` of ``oncely.consumers.service`` when they are
    given no codec. The registry's credentials are secrets: never in a ``repr``, a validation
    error or a log line; only :meth:`schema_registry_config` reveals them, to the client.
    Raises ``pydantic.ValidationError`` (without echoing any value) when the URL carries
    credentials, the basic credentials are not ``user:password``, or a client certificate
    comes without its key (or the reverse).
    """

    model_config = SettingsConfigDict(
        env_prefix="ONCELY_", extra="ignore", hide_input_in_errors=True
    )

    schemas_dir: Path | None = Field(
        default=None,
        description="The committed schema catalog (<event-type>/v<N>.avsc, what `oncely schemas "
        "export` writes); default: ./schemas when that folder exists, else none.",
    )
    schema_registry_url: str | None = Field(
        default=None,
        description="Confluent-compatible schema registry URL, needed by avro-confluent event "
        "types (stage() looks up their schema ids, consumers fetch writer schemas by id).",
    )
    schema_registry_basic_auth_user_info: SecretStr | None = Field(
        default=None,
        description="HTTP basic credentials for the schema registry, as user:password "
        "(basic.auth.user.info; never logged or printed).",
    )
    schema_registry_ssl_ca_location: Path | None = Field(
        default=None,
        description="PEM file of the CA that signed the schema registry's certificate "
        "(default: the system's trust store).",
    )
    schema_registry_ssl_certificate_location: Path | None = Field(
        default=None,
        description="PEM client certificate for a schema registry that requires mutual TLS "
        "(with ONCELY_SCHEMA_REGISTRY_SSL_KEY_LOCATION).",
    )
    schema_registry_ssl_key_location: Path | None = Field(
        default=None, description="PEM private key (unencrypted) of the client certificate."
    )
    schema_registry_auto_register: bool = Field(
        default=False,
        description="Let stage() register an avro-confluent event type's schema on first use, "
        "inside the caller's transaction. Off: schemas are registered by `oncely schemas "
        "register` at deploy time and stage() only looks up their ids.",
    )

    @model_validator(mode="after")
    def _check_registry(self) -> SchemaSettings:
        if self.schema_registry_url and urlsplit(self.schema_registry_url).username is not None:
            raise ValueError(
                "ONCELY_SCHEMA_REGISTRY_URL carries credentials: move them to "
                "ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO (user:password), which is never "
                "logged or printed"
            )
        user_info = self.schema_registry_basic_auth_user_info
        if user_info is not None and ":" not in user_info.get_secret_value():
            raise ValueError("ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO must be user:password")
        if (self.schema_registry_ssl_certificate_location is None) != (
            self.schema_registry_ssl_key_location is None
        ):
            raise ValueError(
                "set both ONCELY_SCHEMA_REGISTRY_SSL_CERTIFICATE_LOCATION and "
                "ONCELY_SCHEMA_REGISTRY_SSL_KEY_LOCATION, or neither"
            )
        return self

    def schema_registry_config(self) -> dict[str, str]:
        """The confluent-kafka ``SchemaRegistryClient`` configuration of these settings.

        It holds the credentials in clear text: never log it. Raises
        :class:`~oncely.errors.ConfigurationError` when no URL is set.
        """
        if not self.schema_registry_url:
            raise ConfigurationError(
                "no schema registry URL: set ONCELY_SCHEMA_REGISTRY_URL (or --schema-registry-url)"
            )
        config = {"url": self.schema_registry_url}
        if self.schema_registry_basic_auth_user_info is not None:
            config["basic.auth.user.info"] = (
                self.schema_registry_basic_auth_user_info.get_secret_value()
            )
        for name, key in _REGISTRY_TLS_KEYS.items():
            value = getattr(self, name)
            if value is not None:
                config[key] = str(value)
        return config


class ConsumerSettings(BaseSettings):
    """How effect consumers poll and apply (``ONCELY_CONSUMER_*``).

    Raises ``pydantic.ValidationError`` when ``assignment_timeout_seconds`` does not exceed the
    session timeout (a rejoin after a lost session takes at least that long).
    """

    model_config = SettingsConfigDict(env_prefix="ONCELY_CONSUMER_", extra="ignore")

    batch_size: int = Field(default=500, ge=1, description="Records applied per transaction.")
    poll_timeout_seconds: float = Field(
        default=0.5,
        gt=0,
        description=(
            "Longest wait for a record when none is buffered; a record that arrives is applied"
            " at once, never after the rest of this wait."
        ),
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /metrics, /healthz and /readyz on this port.",
    )
    session_timeout_ms: int = Field(default=45_000, description="librdkafka session.timeout.ms.")
    assignment_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description=(
            "Longest time without assigned partitions: past it /readyz answers 503, and a"
            " consumer that is out of its group (not rejoining) recreates its Kafka client."
            " Must exceed the session timeout."
        ),
    )
    lanes: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Worker threads applying records, each in its own transactions; a key always goes"
            " to the same lane, so per-key order holds, and a lane keeps taking work while"
            " another is slow. Each lane holds a database connection."
        ),
    )
    prefetch_kbytes: int = Field(
        default=16_384,
        ge=1024,
        description=(
            "Most kilobytes of records fetched ahead of the batch being applied (librdkafka"
            " queued.max.messages.kbytes): what bounds a consumer's memory under a backlog."
        ),
    )

    @model_validator(mode="after")
    def _check_assignment_timeout(self) -> ConsumerSettings:
        if self.assignment_timeout_seconds * 1000 <= self.session_timeout_ms:
            raise ValueError(
                f"ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS ({self.assignment_timeout_seconds:g})"
                f" must exceed the session timeout ({self.session_timeout_ms / 1000:g} s): a"
                " rejoin takes at least that long; raise it or lower"
                " ONCELY_CONSUMER_SESSION_TIMEOUT_MS"
            )
        return self


class WebSettings(BaseSettings):
    """The operator's console, ``oncely web`` (``ONCELY_WEB_*``).

    Without ``user`` and ``password`` the console refuses to start, unless it is bound to
    localhost and started with ``--no-auth``.
    """

    model_config = SettingsConfigDict(env_prefix="ONCELY_WEB_", extra="ignore")

    user: str | None = Field(default=None, description="Basic auth user name.")
    password: SecretStr | None = Field(default=None, description="Basic auth password.")
    read_only: bool = Field(
        default=False,
        description=(
            "Serve no write route at all (requeue, skip, reclaim, republish): the pages only;"
            " works with the least-privilege `console` role."
        ),
    )
    hide_payloads: bool = Field(
        default=False, description="Never show an event's payload (decoded or raw)."
    )
    payload_bytes: int = Field(
        default=4096, ge=64, description="Longest payload shown, in bytes of its text."
    )
    refresh_seconds: float = Field(
        default=5.0, gt=0, description="How often the live figures refresh themselves."
    )


class CompletenessSettings(BaseSettings):
    """How completeness is checked: events older than a grace period without their effect's
    receipt (``ONCELY_COMPLETENESS_*``).

    Read by ``oncely consume`` (it exports ``oncely_effect_missing_events`` for its effects
    every ``interval_seconds``), ``oncely status`` and :func:`oncely.ops.status.collect_status`.
    See :mod:`oncely.consumers.completeness`.
    """

    model_config = SettingsConfigDict(env_prefix="ONCELY_COMPLETENESS_", extra="ignore")

    interval_seconds: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How often a consumer process checks the completeness of its effects and updates"
            " oncely_effect_missing_events; 0 turns the check off."
        ),
    )
    grace_seconds: float = Field(
        default=300.0,
        ge=0,
        description=(
            "How old an event (by the time in its UUIDv7 id, when it was staged) must be before"
            " a missing receipt counts: the time the relay and the consumer normally need."
        ),
    )
    bucket_seconds: float = Field(
        default=60.0,
        ge=1,
        description=(
            "Width of the time buckets compared by count; only buckets whose counts disagree"
            " are read event by event."
        ),
    )
    window_seconds: float = Field(
        default=24 * 3600.0,
        gt=0,
        description=(
            "How far back the check looks (it starts later when the outbox's oldest kept row"
            " is younger)."
        ),
    )
    sample_size: int = Field(
        default=20, ge=1, le=1000, description="Missing event ids listed per effect, oldest first."
    )


class TaskSettings(RenamableSettings):
    """How the task worker leases, retries and purges tasks (``ONCELY_TASKS_*``)."""

    model_config = SettingsConfigDict(env_prefix="ONCELY_TASKS_", extra="ignore")
    renamed: ClassVar[Mapping[str, str]] = {
        "worker_id": "owner_id",
        "poll_seconds": "poll_interval_seconds",
    }

    lease_seconds: float = Field(default=60.0, ge=0.1, description="Lease of one attempt.")
    poll_interval_seconds: float = Field(
        default=2.0,
        ge=0.01,
        description="Longest idle wait between sweeps (NOTIFY wakes the worker sooner).",
    )
    retention_seconds: float = Field(
        default=7 * 24 * 3600.0,
        ge=0,
        description="Delete finished tasks this long after they finished (stale ones are kept).",
    )
    purge_interval_seconds: float = Field(
        default=60.0, gt=0, description="How often the worker purges finished tasks."
    )
    initial_backoff_seconds: float = Field(
        default=1.0, gt=0, description="First wait before a retry (then doubling)."
    )
    max_backoff_seconds: float = Field(
        default=3600.0, ge=0, description="Longest wait between retries."
    )
    owner_id: str | None = Field(
        default=None,
        description="This worker's id as the owner of its task leases (default: "
        "hostname-pid-random).",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /metrics, /healthz and /readyz on this port.",
    )


#: librdkafka's default ``message.max.bytes`` (the relay's producer refuses larger records);
#: the broker's default ``message.max.bytes`` (1,048,588) is a little larger.
PRODUCER_MESSAGE_MAX_BYTES = 1_000_000


class StageLimits(BaseSettings):
    """What ``stage()`` accepts (``ONCELY_STAGE_*``): checked before the row is added.

    The defaults keep a whole record (value, key, headers and framing) under librdkafka's
    default ``message.max.bytes`` (1,000,000 bytes), itself under the broker's default
    (1,048,588): a staged event never becomes a row the relay cannot publish. Raising
    ``max_payload_bytes`` needs the topic's ``max.message.bytes`` and the relay's producer
    ``message.max.bytes`` (``ONCELY_KAFKA_EXTRA``) raised as well.
    """

    model_config = SettingsConfigDict(env_prefix="ONCELY_STAGE_", extra="ignore")

    max_payload_bytes: int = Field(
        default=960_000, ge=1, description="Largest encoded event value (Kafka record value)."
    )
    max_key_bytes: int = Field(
        default=1024,
        ge=1,
        le=2048,
        description="Longest aggregate id (Kafka key), UTF-8 bytes; at most 2048 (index limit).",
    )
    max_headers: int = Field(default=32, ge=0, description="Most extra headers per event.")
    max_headers_bytes: int = Field(
        default=16 * 1024, ge=0, description="Largest total of header names and values, bytes."
    )
