"""Testing helpers: a pytest plugin with real Kafka and PostgreSQL fixtures.

The plugin is registered through the ``pytest11`` entry point, so installing ``oncely[test]``
makes its fixtures available; see :mod:`oncely.testing.plugin`.
"""

from oncely.testing.services import Services, ServicesUnavailableError, provide_services

__all__ = ["Services", "ServicesUnavailableError", "provide_services"]
