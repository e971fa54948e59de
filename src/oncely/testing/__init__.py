"""Testing helpers: a pytest plugin with real Kafka and PostgreSQL fixtures, and helpers for an
application's own tests.

The plugin is opt-in: ``-p oncely.testing`` on pytest's command line (or in ``addopts``), or
``pytest_plugins = ["oncely.testing"]`` in a root ``conftest.py``, adds the ``oncely_*``
fixtures of :mod:`oncely.testing.plugin`. :func:`apply_event` applies an
event to an effect inside a test's transaction (receipts and all, no Kafka);
:func:`staged_events` lists what a transaction staged; :func:`running_pipeline` (the
``oncely_pipeline`` fixture) runs an app's relay and consumers against real Kafka and
PostgreSQL and waits until events are applied.
"""

from oncely.testing.effects import apply_event, apply_event_async, staged_events
from oncely.testing.pipeline import Pipeline, running_consumers, running_pipeline, running_relay
from oncely.testing.services import Services, ServicesUnavailableError, provide_services

#: Loading this module as a pytest plugin loads the fixtures (pytest reads this name).
pytest_plugins = ["oncely.testing.plugin"]

__all__ = [
    "Pipeline",
    "Services",
    "ServicesUnavailableError",
    "apply_event",
    "apply_event_async",
    "provide_services",
    "running_consumers",
    "running_pipeline",
    "running_relay",
    "staged_events",
]
