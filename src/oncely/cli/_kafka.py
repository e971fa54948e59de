"""Kafka for one-shot commands: a broker that does not answer is one error line within seconds,
before the command starts its work."""

from __future__ import annotations

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from oncely.errors import OncelyError
from oncely.security import AuthWatch, wait_for_metadata
from oncely.settings import ClientConfig, KafkaSettings

#: How long a one-shot command waits for a broker's first answer.
REACH_SECONDS = 8.0


class BrokerUnreachableError(OncelyError):
    """No Kafka broker answered a one-shot command within :data:`REACH_SECONDS`."""


def reached(bootstrap_servers: str) -> KafkaSettings:
    """The Kafka settings of a one-shot command, once a broker has answered.

    Raises :class:`BrokerUnreachableError` when none answers within :data:`REACH_SECONDS`, and
    :class:`~oncely.security.KafkaAuthenticationError` when the broker refuses the credentials.
    """
    kafka = KafkaSettings(bootstrap_servers=bootstrap_servers)
    watch = AuthWatch()
    config: ClientConfig = {**kafka.client_config(), "error_cb": watch}
    admin = AdminClient(config)
    try:
        wait_for_metadata(admin, watch, timeout=REACH_SECONDS)
    except KafkaException as exc:
        cause = exc.args[0].str() if exc.args else str(exc)
        raise BrokerUnreachableError(
            f"no Kafka broker answered at {bootstrap_servers} within {REACH_SECONDS:g} s "
            f"({cause}); check --bootstrap-servers (ONCELY_KAFKA_BOOTSTRAP_SERVERS) and that "
            "the broker runs"
        ) from None
    return kafka
