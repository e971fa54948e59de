"""Testing helpers: a pytest plugin with real Kafka and PostgreSQL fixtures, and helpers for an
application's own tests.

The plugin is registered through the ``pytest11`` entry point, so installing ``oncely[test]``
makes its fixtures available; see :mod:`oncely.testing.plugin`. :func:`apply_event` applies an
event to an effect inside a test's transaction (receipts and all, no Kafka);
:func:`staged_events` lists what a transaction staged.
"""

from oncely.testing.effects import apply_event, staged_events
from oncely.testing.services import Services, ServicesUnavailableError, provide_services

__all__ = [
    "Services",
    "ServicesUnavailableError",
    "apply_event",
    "provide_services",
    "staged_events",
]
