"""The relay as a process: wire settings, database, producer, metrics and signals together."""

from __future__ import annotations

import logging
import threading

import sqlalchemy as sa

from oncely.errors import ConfigurationError
from oncely.relay.housekeeping import Housekeeping
from oncely.relay.publisher import REQUIRED, Publisher, TransactionalPublisher
from oncely.relay.relay import Relay
from oncely.relay.signals import Signals
from oncely.relay.topics import TopicState
from oncely.relay.transactions import Transactions
from oncely.runtime.metrics import RelayMetrics
from oncely.runtime.process import database, process_id, serving, stop_on_signals
from oncely.runtime.reach import KafkaReach
from oncely.runtime.tracing import Tracing
from oncely.runtime.wakeup import Wakeup
from oncely.settings import KafkaSettings, RelaySettings, RetentionSettings
from oncely.storage.stores.outbox.relay import RelayStore
from oncely.storage.tables import NOTIFY_CHANNEL
from oncely.wire import progress_topic

log = logging.getLogger(__name__)

#: librdkafka linger.ms unless configured: records of a busy relay's reads batch for this long
#: (a quiet relay sends each read's records at once, see ``Relay``).
BUSY_LINGER_MS = 5
#: How long start-up waits for the broker's answer to find refused credentials.
_CREDENTIALS_TIMEOUT = 10.0


def producer_config(kafka: KafkaSettings, relay: RelaySettings) -> dict[str, object]:
    """librdkafka settings of the relay's producer (``Publisher`` adds the fixed ones)."""
    return {
        **kafka.client_config(),
        "linger.ms": BUSY_LINGER_MS if relay.linger_ms is None else relay.linger_ms,
        "compression.type": relay.compression,
        # Never time a record out inside librdkafka: it would drop it and go on delivering the
        # later records of its partition (a gap: a later event of a key first on the broker).
        # The relay times deliveries itself (delivery_timeout_ms), purging and replaying.
        "message.timeout.ms": 0,
    }


def transactions(
    config: dict[str, object],
    kafka: KafkaSettings,
    relay: RelaySettings,
    reach: KafkaReach | None = None,
) -> Transactions:
    """The shards' transactional producers of exactly-once mode.

    A transaction stays open at most one lease (``transaction.timeout.ms``): the broker aborts
    a dead or paused owner's, which holds its partitions' ``read_committed`` readers until then.
    A record may wait that long too (``message.timeout.ms`` may not be longer; one timed out
    aborts its page's transaction, which replays whole, so no gap). ``reach``: the process's
    watch over its clients' outages (default: their own).
    """
    timeout_ms = max(1000, round(relay.lease_seconds * 1000))
    return Transactions(
        {**config, **REQUIRED, "message.timeout.ms": timeout_ms},
        client=kafka.client_config(),
        prefix=relay.transactional_id_prefix,
        transaction_timeout_ms=timeout_ms,
        timeout=max(10.0, relay.lease_seconds),
        reach=reach,
    )


def session_options(database_url: str, settings: RelaySettings) -> str:
    """libpq ``options`` of the relay's connections: the URL's own, plus a server-side end to
    a transaction left idle for ``lease_seconds``.

    Leases are taken with ``FOR UPDATE SKIP LOCKED``: a relay paused (SIGSTOP, a frozen VM)
    inside one of its short transactions would keep its shards' rows locked, so no relay could
    take them over until it resumed. The server ends such a transaction (and its connection)
    instead; the paused relay finds its leases lost when it resumes.
    """
    timeout_ms = max(1000, round(settings.lease_seconds * 1000))
    own = sa.make_url(database_url).query.get("options")
    own_text = " ".join(own) if isinstance(own, tuple) else (own or "")
    return f"{own_text} -c idle_in_transaction_session_timeout={timeout_ms}".strip()


def build_relay(
    *,
    engine: sa.Engine,
    kafka: KafkaSettings,
    settings: RelaySettings,
    stop: threading.Event,
    metrics: RelayMetrics | None = None,
    tracing: Tracing | None = None,
    retention: RetentionSettings | None = None,
    signals: Signals | None = None,
) -> Relay:
    """A :class:`Relay` over ``engine`` and Kafka, listening for staged rows; ``tracing``
    records its PRODUCER spans (default: the global tracer provider); ``retention`` says what
    its purge timer does on partitioned tables (default: read from ``ONCELY_RETENTION_*``);
    ``signals`` receives what the relay does (for tests to wait on).

    Raises :class:`~oncely.security.KafkaAuthenticationError` when the broker refuses the
    credentials (checked before anything is read; an unreachable broker is not an error).
    """
    owner = settings.owner_id or process_id()
    config = producer_config(kafka, settings)
    reach = KafkaReach()  # every Kafka client of the relay: two lines per outage

    def publisher() -> Publisher:
        made = (
            TransactionalPublisher(
                config,
                client=kafka.client_config(),
                transactions=transactions(config, kafka, settings, reach),
                cloudevents_source=settings.cloudevents_source,
                tracing=tracing,
                reach=reach,
            )
            if settings.exactly_once
            else Publisher(
                config,
                client=kafka.client_config(),
                cloudevents_source=settings.cloudevents_source,
                tracing=tracing,
                reach=reach,
            )
        )
        made.check_credentials(timeout=_CREDENTIALS_TIMEOUT)
        progress = progress_topic(settings.transactional_id_prefix)
        if settings.exactly_once and made.topic_state(progress) is TopicState.MISSING:
            raise ConfigurationError(
                f"exactly-once mode commits each page with its progress to the topic {progress}, "
                "which is missing: create it with `oncely topics ensure --exactly-once` "
                "(ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX sets its prefix)"
            )
        return made

    store = RelayStore(engine, owner=owner, exactly_once=settings.exactly_once)
    metrics = metrics or RelayMetrics()
    return Relay(
        store=store,
        publisher_factory=publisher,
        settings=settings,
        metrics=metrics,
        wakeup=Wakeup.of(engine, channel=NOTIFY_CHANNEL, stop=stop),
        housekeeping=Housekeeping(
            store=store,
            settings=settings,
            retention_settings=retention or RetentionSettings(),
            kafka=reach.client_config(kafka.client_config()),
            metrics=metrics.retention,
        ),
        signals=signals,
    )


def run_relay(*, database_url: str, kafka: KafkaSettings, settings: RelaySettings) -> None:
    """Run a relay until SIGTERM or SIGINT, then drain gracefully and return.

    Raises :class:`~oncely.security.KafkaAuthenticationError` when the broker refuses the
    credentials, at start-up or later (the leases it holds are given back first).
    """
    # No pre-ping: every database error is handled by the loop, and a broken connection is
    # replaced on the next call.
    options = {"options": session_options(database_url, settings)}
    metrics = RelayMetrics()
    built: list[Relay] = []  # the port is bound first: a taken one is the only error
    with (
        stop_on_signals() as stop,
        database(database_url, pool_size=2, connect_args=options) as engine,
        serving(
            settings.metrics_port,
            registry=metrics.registry,
            healthy=lambda: all(relay.healthy() for relay in built),
            ready=lambda: bool(built) and built[0].ready(),
        ) as server,
    ):
        relay = build_relay(
            engine=engine, kafka=kafka, settings=settings, stop=stop, metrics=metrics
        )
        built.append(relay)
        log.info(
            "relay started",
            extra={
                "relay_id": relay.store.owner,
                "bootstrap_servers": kafka.bootstrap_servers,
                "metrics_port": server.port if server else None,
            },
        )
        relay.run(stop)
