"""How the relay reads a failed delivery, as pure functions: transient or permanent, and when a
row goes dead.

A delivery error is *transient* when the broker could not take the record right now (it is
unreachable, has no leader, lacks in-sync replicas, timed out): the row backs off and retries
without ever going dead, so a broker outage delays events but never dead-letters them. A topic
missing or not authorised is neither: it blocks the topic (:mod:`oncely.relay.topics`). Any
other error (record too large, invalid) is *permanent*: after ``max_attempts`` the row goes
``dead`` with the error, and its key waits for an operator.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from oncely import errors

_TRANSIENT = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError._FATAL,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.BROKER_NOT_AVAILABLE,
    }
)


def is_transient(error: KafkaError) -> bool:
    """Whether a failed delivery should retry forever (broker trouble) or count toward dead."""
    return error.code() in _TRANSIENT


def goes_dead(error: KafkaError, attempts: int, *, max_attempts: int) -> bool:
    """A permanent error on the ``max_attempts``-th try makes the row dead."""
    return not is_transient(error) and attempts >= max_attempts


def error_text(error: KafkaError) -> str:
    """The row's ``last_error``: the error's name and text, at most 4,000 characters."""
    return errors.error_text(f"{error.name()}: {error.str()}")
