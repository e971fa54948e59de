"""A relay and effect consumers run in this process, with settings quick enough for tests;
a relay run until rows are published."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import sqlalchemy as sa

from oncely import testing
from oncely.consumers.effects import Effects
from oncely.consumers.runner import EffectConsumer
from oncely.relay import Relay
from oncely.relay.signals import Signals
from oncely.runtime.tracing import Tracing
from oncely.settings import ConsumerSettings, KafkaSettings, RelaySettings
from tests.helpers.outbox import count_published
from tests.helpers.probes import wait_until


def fast_settings(**overrides: object) -> RelaySettings:
    values: dict[str, object] = {
        "lease_seconds": 10.0,
        "poll_interval_seconds": 0.2,
        "initial_backoff_seconds": 0.2,
        "max_backoff_seconds": 2.0,
        "delivery_timeout_ms": 10_000,
        "purge_interval_seconds": 3600.0,
        "shutdown_timeout_seconds": 15.0,
        **overrides,
    }
    return RelaySettings(**values)  # type: ignore[arg-type]


def running_relay(
    engine: sa.Engine,
    bootstrap: str,
    settings: RelaySettings,
    *,
    tracing: Tracing | None = None,
    kafka: KafkaSettings | None = None,
) -> contextlib.AbstractContextManager[Relay]:
    """:func:`oncely.testing.running_relay` on a PLAINTEXT ``bootstrap`` (or ``kafka``), with
    :func:`signals_of` to wait on."""
    kafka = kafka or KafkaSettings(bootstrap_servers=bootstrap)
    return testing.running_relay(engine, kafka, settings, tracing=tracing, signals=Signals())


def signals_of(relay: Relay) -> Signals:
    """The signals of a relay :func:`running_relay` started."""
    assert relay.signals is not None, "a relay started with signals"
    return relay.signals


def publish_all(
    engine: sa.Engine,
    bootstrap: str,
    count: int,
    settings: RelaySettings | None = None,
    *,
    tracing: Tracing | None = None,
    timeout: float = 60,
) -> Relay:
    """Run a relay (:func:`fast_settings` unless ``settings``) until ``count`` rows are
    published (:func:`~tests.helpers.outbox.count_published`), then stop it; the relay is
    returned, stopped, for its metrics."""
    with running_relay(engine, bootstrap, settings or fast_settings(), tracing=tracing) as relay:
        wait_until(lambda: count_published(engine) == count, timeout=timeout)
    return relay


def running_consumers(
    effects: Effects,
    names: Sequence[str],
    engine: sa.Engine,
    bootstrap: str,
    *,
    lanes: int = 1,
    tracing: Tracing | None = None,
    **settings: object,
) -> contextlib.AbstractContextManager[list[EffectConsumer]]:
    """:func:`oncely.testing.running_consumers` with short polls and batches of 200;
    ``settings`` are more :class:`~oncely.settings.ConsumerSettings` fields."""
    values = {"batch_size": 200, "poll_timeout_seconds": 0.2, "lanes": lanes, **settings}
    return testing.running_consumers(
        effects,
        names,
        engine,
        KafkaSettings(bootstrap_servers=bootstrap),
        ConsumerSettings(**values),  # type: ignore[arg-type]
        tracing=tracing,
    )
