"""Whether a process's Kafka clients reach the brokers, told in two lines per outage.

While no broker answers, librdkafka retries every few hundred milliseconds, and each client
logs each failed attempt (``Connect to ... failed``) and reports it to its ``error_cb``: about
ten lines a second per process. A process gives every Kafka client it makes the same
:class:`KafkaReach` (:meth:`KafkaReach.client_config`), which writes instead:

* ``Kafka brokers unreachable (<librdkafka's reason>): the clients keep retrying; their lines
  are counted, not logged, until a broker answers`` (WARNING), once a client reports that
  every broker is down (``_ALL_BROKERS_DOWN``);
* ``Kafka brokers reachable again after <s> s; <n> librdkafka lines and client errors were
  not logged`` (INFO), once a client's statistics show a broker up (or a record is
  acknowledged, :meth:`KafkaReach.reached`) and no client reported a failure for
  :data:`QUIET` seconds since: clients serve their callbacks when they are polled, so news of
  the outage can arrive after a broker answered.

In between, every librdkafka line and every error a client reports is counted instead of
logged, except refused credentials and fatal errors (they go on to the client's own
``error_cb``). Outside an outage the clients' lines and errors pass as they are.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError

from oncely.security import is_authentication_failure
from oncely.settings import KAFKA_LOGGER, ClientConfig

log = logging.getLogger(__name__)

#: How often each client reports its brokers' states (``statistics.interval.ms``, unless the
#: configuration sets it): how soon a recovery is seen.
STATISTICS_MS = 5000
#: Seconds without a failure reported, after a broker answered, before the brokers count as
#: reachable again.
QUIET = 5.0
#: librdkafka's facility of its lines about a broker connection that failed or dropped.
_FAILURE_FACILITY = "FAIL"


class KafkaReach:
    """The reachability of the brokers as a process's Kafka clients see it; thread-safe (each
    client calls it from the thread that polls it)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds."""
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        #: During an outage: when a broker answered with no failure reported since.
        self._answered: float | None = None
        self._untold = 0
        #: The last failure a client reported before the outage, and when.
        self._last_failure: tuple[float, str] | None = None

    @property
    def down(self) -> bool:
        """Every broker is down: from a client's report of it until they are reachable again."""
        return self._down_since is not None

    def client_config(self, config: Mapping[str, Any]) -> ClientConfig:
        """``config`` for a client this object watches: its log lines (then passed to the
        ``logger`` of ``config``, default :data:`~oncely.settings.KAFKA_LOGGER`), its errors
        (then passed to the ``error_cb`` of ``config``, unless they are about the outage)
        and its statistics (every :data:`STATISTICS_MS` unless ``config`` says otherwise)."""
        own_error: Callable[[KafkaError], object] | None = config.get("error_cb")

        def on_error(error: KafkaError) -> None:
            if not self.error(error) and own_error is not None:
                own_error(error)

        return {
            "statistics.interval.ms": STATISTICS_MS,
            **config,
            "logger": _Lines(self, config.get("logger", KAFKA_LOGGER)),
            "error_cb": on_error,
            "stats_cb": self.statistics,
        }

    def error(self, error: KafkaError) -> bool:
        """Take a client's error; whether it was about the outage (then this object told it or
        counted it, and the client should not log it)."""
        if error.fatal() or is_authentication_failure(error):
            return False
        with self._lock:
            if error.code() == KafkaError._ALL_BROKERS_DOWN:
                reason = error.str()
                last = self._last_failure
                if last is not None and self._clock() - last[0] < QUIET:  # not an old one
                    reason = f"{reason}; last: {last[1]}"
                self._fail(reason)
                return True
            if self._down_since is None:
                if error.code() == KafkaError._TRANSPORT:
                    self._last_failure = (self._clock(), error.str())
                return False
            self._untold += 1
            self._answered = None
            return True

    def statistics(self, text: str) -> None:
        """A client's statistics (its ``stats_cb``): a broker up in them is an answer."""
        if self._down_since is None:
            return
        brokers = json.loads(text).get("brokers", {})
        if any(broker.get("state") == "UP" for broker in brokers.values()):
            self.reached()

    def reached(self) -> None:
        """A broker answered (e.g. acknowledged a record)."""
        if not self.down:  # the usual case, without the lock
            return
        with self._lock:
            if self._down_since is None:
                return
            now = self._clock()
            if self._answered is None:
                self._answered = now
            elif now - self._answered >= QUIET:
                log.info(
                    "Kafka brokers reachable again after %.1f s; %d librdkafka lines and client"
                    " errors were not logged",
                    self._answered - self._down_since,
                    self._untold,
                    extra={
                        "outage_seconds": round(self._answered - self._down_since, 1),
                        "not_logged": self._untold,
                    },
                )
                self._down_since = self._answered = self._last_failure = None
                self._untold = 0

    def line(self, facility: str, text: str) -> bool:
        """Take a librdkafka line; whether to log it (``False``: it was counted)."""
        with self._lock:
            if self._down_since is None:
                if facility == _FAILURE_FACILITY:
                    self._last_failure = (self._clock(), text)
                return True
            self._untold += 1
            if facility == _FAILURE_FACILITY:
                self._answered = None
            return False

    def _fail(self, reason: str) -> None:
        """Every broker is down (call with the lock held)."""
        self._answered = None
        if self._down_since is not None:
            self._untold += 1
            return
        self._down_since = self._clock()
        log.warning(
            "Kafka brokers unreachable (%s): the clients keep retrying; their lines are"
            " counted, not logged, until a broker answers",
            reason,
        )


class _Lines:
    """A client's ``logger``: confluent-kafka calls ``log(level, "%s [%s] %s", facility,
    client, text)`` for each librdkafka line."""

    def __init__(self, reach: KafkaReach, logger: Any) -> None:
        self._reach = reach
        self._logger = logger

    def log(self, level: int, msg: str, *args: Any) -> None:
        facility, text = (str(args[0]), str(args[2])) if len(args) == 3 else ("", msg)
        if self._reach.line(facility, text):
            self._logger.log(level, msg, *args)
