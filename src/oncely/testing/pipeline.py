"""Run an application's pipeline inside its own tests: the relay and the effects' consumers on
threads, against real Kafka and PostgreSQL, and wait until events are applied.

::

    def test_a_transfer_sends_its_receipt(oncely_pipeline):
        with oncely_pipeline(app) as pipeline:
            with Session(pipeline.engine) as session, session.begin():
                staged = oncely.stage(session, TransferRequested(...))
            pipeline.wait_until_applied([staged])

The ``oncely_pipeline`` fixture (:mod:`oncely.testing.plugin`) gives :func:`running_pipeline`
with the plugin's database and broker; outside pytest call it with your own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from oncely.app import App
from oncely.consumers.effects import Effects
from oncely.consumers.runner import EffectConsumer
from oncely.consumers.service import build_consumers
from oncely.relay.relay import Relay
from oncely.relay.service import build_relay
from oncely.relay.signals import Signals
from oncely.runtime.metrics import ConsumerMetrics, RelayMetrics
from oncely.runtime.tracing import Tracing
from oncely.settings import ConsumerSettings, KafkaSettings, RelaySettings, TopicSettings
from oncely.storage.stores import receipts
from oncely.storage.stores.outbox.writes import StagedEvent
from oncely.topics import ensure_topics, planned_topics

__all__ = ["Pipeline", "running_consumers", "running_pipeline", "running_relay"]

#: How long a relay or consumer thread may take to drain and stop when its block ends.
STOP_SECONDS = 60.0


@contextlib.contextmanager
def running_relay(
    engine: sa.Engine,
    kafka: KafkaSettings,
    settings: RelaySettings | None = None,
    *,
    tracing: Tracing | None = None,
    signals: Signals | None = None,
) -> Iterator[Relay]:
    """A relay on a thread for the block; afterwards it drains, gives its shards back and stops.
    ``signals`` receives what it does (shards taken, lost, replayed, progress recorded, keys
    released), for a test to wait on with :meth:`~oncely.relay.signals.Signals.wait_for`.

    Raises:
        AssertionError: the relay did not stop within :data:`STOP_SECONDS`.
    """
    stop = threading.Event()
    relay = build_relay(
        engine=engine,
        kafka=kafka,
        settings=settings or RelaySettings(),
        stop=stop,
        metrics=RelayMetrics(),
        tracing=tracing,
        signals=signals,
    )
    thread = threading.Thread(target=relay.run, args=(stop,), name="oncely-relay", daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        stop.set()
        thread.join(timeout=STOP_SECONDS)
        assert not thread.is_alive(), f"the relay did not stop within {STOP_SECONDS:g} s"


@contextlib.contextmanager
def running_consumers(
    effects: Effects,
    names: Sequence[str],
    engine: sa.Engine,
    kafka: KafkaSettings,
    settings: ConsumerSettings | None = None,
    *,
    tracing: Tracing | None = None,
) -> Iterator[list[EffectConsumer]]:
    """One consumer per effect in ``names``, each on a thread for the block; afterwards each
    commits what it applied and stops.

    Raises:
        ConfigurationError: a name is not one of ``effects``.
        AssertionError: a consumer did not stop within :data:`STOP_SECONDS`.
    """
    stop = threading.Event()
    consumers = build_consumers(
        effects=effects,
        names=names,
        engine=engine,
        kafka=kafka,
        settings=settings or ConsumerSettings(),
        metrics=ConsumerMetrics(),
        tracing=tracing,
    )
    threads = [
        threading.Thread(target=consumer.run, args=(stop,), name=f"oncely-{name}", daemon=True)
        for consumer, name in zip(consumers, names, strict=True)
    ]
    for thread in threads:
        thread.start()
    try:
        yield consumers
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=STOP_SECONDS)
            assert not thread.is_alive(), f"a consumer did not stop within {STOP_SECONDS:g} s"


@dataclass(frozen=True)
class Pipeline:
    """A running pipeline: its database ``engine`` (stage through it) and the effects it
    applies."""

    engine: sa.Engine
    effects: Sequence[str]

    def wait_until_applied(
        self,
        events: Iterable[StagedEvent | UUID],
        *,
        effects: Sequence[str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Return once every event has a receipt of every effect in ``effects`` (default: all
        of the pipeline's), i.e. was applied and committed.

        Raises:
            TimeoutError: some (event, effect) pairs were not applied within ``timeout``
                seconds; the message names the first of them.
        """
        ids = sorted({event.id if isinstance(event, StagedEvent) else event for event in events})
        wanted = list(effects if effects is not None else self.effects)
        expected = {(event_id, effect) for event_id in ids for effect in wanted}
        deadline = time.monotonic() + timeout
        while True:
            with self.engine.connect() as conn:
                found = receipts.applied_pairs(conn, ids, wanted)
            missing = sorted(expected - found)
            if not missing:
                return
            if time.monotonic() >= deadline:
                event_id, effect = missing[0]
                raise TimeoutError(
                    f"{len(missing)} of {len(expected)} (event, effect) pairs not applied "
                    f"within {timeout:g} s, the first: event {event_id} by {effect!r}; check "
                    "that the effect consumes the event's type and the logs of its consumer"
                )
            time.sleep(0.05)


@contextlib.contextmanager
def running_pipeline(
    app: App,
    *,
    database_url: str,
    bootstrap_servers: str,
    effects: Sequence[str] | None = None,
    relay: RelaySettings | None = None,
    consumer: ConsumerSettings | None = None,
) -> Iterator[Pipeline]:
    """``app``'s pipeline for the block: its topics created (as ``oncely topics ensure`` does,
    with one partition each and the broker's replication), a relay, and one consumer for each
    effect in ``effects`` (default: all of them), against a database with oncely's tables.

    Raises:
        AppError: ``app`` declares no effects.
        ConfigurationError: an effect name is not one of the app's.
    """
    declared = app.require_effects("the app given to running_pipeline")
    names = list(effects if effects is not None else declared.names())
    for name in names:
        declared.get(name)
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers)
    topics = TopicSettings(partitions=1, replication_factor=1, min_insync_replicas=1, overrides={})
    specs = planned_topics(declared.registry, topics, effects=[declared.get(n) for n in names])
    ensure_topics(AdminClient(kafka.client_config()), specs)
    engine = sa.create_engine(database_url)
    try:
        with (
            running_relay(engine, kafka, relay),
            running_consumers(declared, names, engine, kafka, consumer),
        ):
            yield Pipeline(engine=engine, effects=tuple(names))
    finally:
        engine.dispose()
