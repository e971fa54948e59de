"""Effect consumers as a process: one consumer (and group) per effect, each on its own thread,
and one thread checking their completeness (:mod:`oncely.consumers.completeness`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import sqlalchemy as sa

from oncely.consumers.completeness import CompletenessWatch
from oncely.consumers.dlq import DeadLetters
from oncely.consumers.effects import Effects
from oncely.consumers.runner import EffectConsumer
from oncely.runtime.metrics import ConsumerMetrics
from oncely.runtime.process import database, serving, stop_on_signals
from oncely.runtime.reach import KafkaReach
from oncely.runtime.tracing import Tracing
from oncely.schemas.codec import Codec
from oncely.schemas.loader import codec_for
from oncely.settings import CompletenessSettings, ConsumerSettings, KafkaSettings, TopicSettings
from oncely.topics import dead_letter_topics

log = logging.getLogger(__name__)


def build_consumers(
    *,
    effects: Effects,
    names: Sequence[str],
    engine: sa.Engine,
    kafka: KafkaSettings,
    settings: ConsumerSettings,
    metrics: ConsumerMetrics,
    codec: Codec | None = None,
    stop: threading.Event | None = None,
    topics: TopicSettings | None = None,
    tracing: Tracing | None = None,
) -> list[EffectConsumer]:
    """One :class:`EffectConsumer` per effect name, sharing the engine, codec and DLQ producer.

    Without ``codec``, the codec reads the committed schema catalog and schema registry of
    :class:`~oncely.settings.SchemaSettings` (``ONCELY_SCHEMAS_DIR``, else ``./schemas`` when
    it exists; ``ONCELY_SCHEMA_REGISTRY_URL``), see :func:`oncely.schemas.loader.codec_for`.
    Creates each effect's missing dead-letter topics as ``oncely topics ensure --effects`` does
    (the source topic's layout from ``topics``, default ``ONCELY_TOPICS_*``; see
    :meth:`DeadLetters.ensure_topics`). An unreachable broker raises ``KafkaException``; with
    ``stop``, it is waited for instead until ``stop`` is set. A missing or malformed catalog
    raises ``CatalogError``. ``tracing`` records the handlers' spans (default: the global
    tracer provider).
    """
    codec = codec or codec_for(effects.registry)
    reach = KafkaReach()  # every Kafka client of the process: two lines per outage
    dead_letters = DeadLetters(kafka.client_config(), reach=reach)
    consumers = []
    for name in names:
        effect = effects.get(name)
        dead_letters.ensure_topics(
            dead_letter_topics(effects.registry, topics or TopicSettings(), [effect]), until=stop
        )
        consumers.append(
            EffectConsumer(
                effect=effect,
                group_id=effects.group_id(name),
                codec=codec,
                engine=engine,
                kafka=kafka,
                settings=settings,
                metrics=metrics,
                dead_letters=dead_letters,
                tracing=tracing,
                reach=reach,
            )
        )
    return consumers


def run_consumers(
    *,
    effects: Effects,
    names: Sequence[str],
    database_url: str,
    kafka: KafkaSettings,
    settings: ConsumerSettings,
    codec: Codec | None = None,
    completeness: CompletenessSettings | None = None,
) -> None:
    """Run the named effects until SIGTERM/SIGINT; commit what was applied, then return.

    When one effect's consumer fails (e.g. :class:`~oncely.security.KafkaAuthenticationError`
    for refused credentials), the others are stopped too and its exception is raised. Every
    ``completeness.interval_seconds`` (default: ``ONCELY_COMPLETENESS_*``; 0: never) another
    thread checks the effects' completeness and exports ``oncely_effect_missing_events``.
    """
    completeness = completeness or CompletenessSettings()
    pool_size = max(2, len(names) * settings.lanes) + 1  # one for the completeness check
    with (
        stop_on_signals() as stop,
        database(database_url, pool_pre_ping=True, pool_size=pool_size) as engine,
    ):
        metrics = ConsumerMetrics()
        consumers = build_consumers(
            effects=effects,
            names=names,
            engine=engine,
            kafka=kafka,
            settings=settings,
            metrics=metrics,
            codec=codec,
            stop=stop,
        )
        watch = None
        if completeness.interval_seconds > 0:
            watch = CompletenessWatch(engine, [c.effect for c in consumers], completeness, metrics)
        with serving(
            settings.metrics_port,
            registry=metrics.registry,
            healthy=lambda: all(c.healthy() for c in consumers),
            ready=lambda: all(c.ready() for c in consumers),
        ):
            _run_threads(consumers, stop, watch)
    log.info("consumers stopped", extra={"effects": list(names)})


def _run_threads(
    consumers: Sequence[EffectConsumer], stop: threading.Event, watch: CompletenessWatch | None
) -> None:
    """Run each consumer on its own thread until ``stop`` or one fails (then raise its error),
    and ``watch`` on one more."""
    failures: list[BaseException] = []

    def run(consumer: EffectConsumer) -> None:
        try:
            consumer.run(stop)
        except BaseException as exc:  # raised again in the main thread, after the others stop
            failures.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=run, args=(c,), name=f"effect-{c.effect.name}") for c in consumers
    ]
    if watch is not None:
        threads.append(threading.Thread(target=watch.run, args=(stop,), name="completeness"))
    for thread in threads:
        thread.start()
    log.info("consumers started", extra={"effects": [c.effect.name for c in consumers]})
    while any(t.is_alive() for t in threads[: len(consumers)]) and not stop.is_set():
        stop.wait(0.5)
    stop.set()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
