"""Kafka authentication failures: recognise them, and stop with a message that says what to fix.

librdkafka treats refused credentials like any connection problem: it reports the error to
the client's ``error_cb`` and reconnects forever. A relay or consumer that kept running would
look alive while doing nothing. oncely's processes therefore watch for
``KafkaError._AUTHENTICATION`` and exit non-zero with :class:`KafkaAuthenticationError`, whose
message names the settings to check. The broker's text is kept (it never contains the
password); the configured secrets are never part of a message.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from oncely.errors import ConfigurationError

__all__ = [
    "AuthWatch",
    "KafkaAuthenticationError",
    "is_authentication_failure",
    "wait_for_metadata",
]

_HINT = (
    "check ONCELY_KAFKA_SASL_USERNAME and ONCELY_KAFKA_SASL_PASSWORD (and "
    "ONCELY_KAFKA_SASL_MECHANISM, ONCELY_KAFKA_SECURITY_PROTOCOL, or the same keys in "
    "ONCELY_KAFKA_EXTRA) against the broker's users"
)


class KafkaAuthenticationError(ConfigurationError):
    """Kafka refused oncely's credentials: check the ONCELY_KAFKA_SASL_* settings."""

    @classmethod
    def of(cls, error: KafkaError) -> KafkaAuthenticationError:
        """The exception for librdkafka's ``error``, with the broker's reason and the fix."""
        return cls(f"Kafka refused the credentials ({error.str()}): {_HINT}")


def is_authentication_failure(error: KafkaError) -> bool:
    """Whether ``error`` means the broker refused the credentials (not a passing outage)."""
    return bool(error.code() == KafkaError._AUTHENTICATION)


class AuthWatch:
    """An ``error_cb`` for librdkafka clients that remembers the first authentication failure.

    Pass it as ``{"error_cb": watch}``; callbacks run inside the client's ``poll()`` (or
    ``consume()``). :meth:`check` raises once a failure was seen; other errors are ignored
    here (the client retries them), except that :attr:`brokers_down` remembers librdkafka's
    ``_ALL_BROKERS_DOWN`` (every known broker refused or dropped the connection).
    """

    def __init__(self) -> None:
        self.failure: KafkaError | None = None
        self.brokers_down = False

    def __call__(self, error: KafkaError) -> None:
        if self.failure is None and is_authentication_failure(error):
            self.failure = error
        elif error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.brokers_down = True

    def check(self) -> None:
        """Raise :class:`KafkaAuthenticationError` if an authentication failure was seen."""
        if self.failure is not None:
            raise KafkaAuthenticationError.of(self.failure)


def wait_for_metadata(
    client: Any, watch: AuthWatch, *, timeout: float, until_brokers_down: bool = False
) -> Any:
    """``client.list_topics()``, failing within about a second when credentials are refused.

    ``client`` is an ``AdminClient`` or a ``Producer`` configured with ``error_cb=watch`` (not
    a ``Consumer``: its ``poll()`` would consume). Returns the cluster metadata. With
    ``until_brokers_down`` it also gives up, within about a second, once every broker refused
    the connection (a one-shot reader that need not wait out ``timeout`` for a broker that is
    not there).

    Raises:
        KafkaAuthenticationError: the broker refused the credentials.
        KafkaException: no metadata within ``timeout`` seconds for another reason.
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            return client.list_topics(timeout=max(0.1, min(1.0, remaining)))
        except KafkaException:
            client.poll(0)  # serves error_cb
            watch.check()
            if time.monotonic() >= deadline or (until_brokers_down and watch.brokers_down):
                raise
