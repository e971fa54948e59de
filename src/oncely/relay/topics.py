"""Which topics the relay holds back because the broker does not have them (or refuses them).

A topic that does not exist yet (a service deployed before ``oncely topics ensure``) or that the
relay is not authorised to describe is *blocked*: its rows are parked by key instead of being
produced, and the broker's metadata is asked again with backoff until the topic appears. A
topic is learnt once, from metadata, before the first row is produced to it; a known topic is
blocked again only when a delivery report says it vanished (deleted, or its ACL changed).

:class:`TopicWatch` keeps that state and logs one WARNING when a topic becomes blocked and one
when it is back, never one per retry.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaError

from oncely.runtime.retry import Backoff

log = logging.getLogger(__name__)


#: A blocked topic is asked about at least this often (seconds): one metadata request, so its
#: rows go out within seconds of the topic being created.
TOPIC_CHECK_MAX = 5.0


class TopicState(enum.Enum):
    """What the broker's metadata says of a topic."""

    EXISTS = "exists"
    MISSING = "missing"
    DENIED = "not authorised"
    #: No answer (the broker is unreachable): the relay produces and lets librdkafka wait.
    UNKNOWN = "unknown"


_MISSING = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
_DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED})


def topic_error_state(error: KafkaError) -> TopicState | None:
    """The topic state a delivery error reports (``None``: the error is about the record)."""
    if error.code() in _MISSING:
        return TopicState.MISSING
    if error.code() in _DENIED:
        return TopicState.DENIED
    return None


@dataclass(slots=True)
class _Blocked:
    state: TopicState
    since: float
    checks: int = 0
    check_at: float = 0.0


class TopicWatch:
    """The topics known to exist and the blocked ones, asking ``probe`` (the broker's metadata)
    about a topic the first time it is seen and, while blocked, again after each ``backoff``."""

    def __init__(
        self,
        *,
        probe: Callable[[str], TopicState],
        backoff: Backoff,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._backoff = backoff
        self._clock = clock
        self._known: set[str] = set()
        self._blocked: dict[str, _Blocked] = {}
        self._unsure: dict[str, float] = {}

    @property
    def blocked_topics(self) -> frozenset[str]:
        """The topics blocked now (as last checked)."""
        return frozenset(self._blocked)

    def state(self, topic: str) -> TopicState:
        """What is known of ``topic`` now, without asking the broker."""
        blocked = self._blocked.get(topic)
        if blocked is not None:
            return blocked.state
        return TopicState.EXISTS if topic in self._known else TopicState.UNKNOWN

    def is_blocked(self, topic: str) -> bool:
        """Whether rows of ``topic`` must wait; asks the broker when it is time to.

        Known topics cost a set lookup. A topic seen for the first time is probed at once; a
        blocked one is probed again once its backoff has passed, and unblocked when it exists.
        A topic the broker did not answer about is not blocked (librdkafka waits for it), and
        is probed again after the first backoff.
        """
        if topic in self._known:
            return False
        now = self._clock()
        blocked = self._blocked.get(topic)
        if blocked is not None and now < blocked.check_at:
            return True
        if blocked is None and now < self._unsure.get(topic, -math.inf):
            return False
        state = self._probe(topic)
        if state is TopicState.EXISTS:
            self._exists(topic)
            return False
        if state is TopicState.UNKNOWN:
            if blocked is None:
                self._unsure[topic] = now + self._backoff.first
                return False
            state = blocked.state
        self.block(topic, state)
        return True

    def forget(self, topics: Iterable[str]) -> None:
        """Ask the broker about ``topics`` again before the next row goes to them (their
        deliveries are overdue: a topic may have been deleted)."""
        self._known.difference_update(topics)

    def block(self, topic: str, state: TopicState) -> None:
        """``topic`` is missing or not authorised (from metadata, or a delivery report)."""
        self._known.discard(topic)
        self._unsure.pop(topic, None)
        now = self._clock()
        blocked = self._blocked.get(topic)
        if blocked is None:
            blocked = self._blocked[topic] = _Blocked(state, now)
            log.warning(
                "topic %s is %s: its rows are held, in order per key, and published when it "
                "exists (create it with `oncely topics ensure`, or grant the relay access)",
                topic,
                state.value,
                extra={"topic": topic, "state": state.value},
            )
        blocked.state = state
        blocked.checks += 1
        blocked.check_at = now + self._backoff.delay(blocked.checks)

    def _exists(self, topic: str) -> None:
        self._known.add(topic)
        self._unsure.pop(topic, None)
        blocked = self._blocked.pop(topic, None)
        if blocked is not None:
            log.warning(
                "topic %s exists now, after %.0f s %s: publishing its held rows",
                topic,
                self._clock() - blocked.since,
                blocked.state.value,
                extra={"topic": topic},
            )
