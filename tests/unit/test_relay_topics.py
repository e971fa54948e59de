"""TopicWatch, the relay's record of blocked topics: when it asks the broker, what it logs."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from oncely.relay.topics import TopicState, TopicWatch, topic_error_state
from oncely.runtime.retry import Backoff


class _Broker:
    """A fake metadata probe: each topic's state, and every question asked."""

    def __init__(self) -> None:
        self.states: dict[str, TopicState] = {}
        self.asked: list[str] = []

    def probe(self, topic: str) -> TopicState:
        self.asked.append(topic)
        return self.states.get(topic, TopicState.MISSING)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(broker: _Broker, clock: _Clock) -> TopicWatch:
    return TopicWatch(probe=broker.probe, backoff=Backoff(first=1.0, maximum=8.0), clock=clock)


def test_a_known_topic_is_asked_about_once() -> None:
    broker, clock = _Broker(), _Clock()
    broker.states["orders"] = TopicState.EXISTS
    watch = _watch(broker, clock)
    assert [watch.is_blocked("orders") for _ in range(5)] == [False] * 5
    assert broker.asked == ["orders"]


def test_a_missing_topic_is_asked_again_with_backoff_and_unblocked_once_it_exists(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="oncely.relay.topics")
    broker, clock = _Broker(), _Clock()
    watch = _watch(broker, clock)
    assert watch.is_blocked("refunds")
    assert watch.blocked_topics == {"refunds"}
    clock.now += 0.9
    assert watch.is_blocked("refunds") and broker.asked == ["refunds"], "not before the backoff"
    clock.now += 0.2
    assert watch.is_blocked("refunds") and len(broker.asked) == 2
    clock.now += 1.5
    assert watch.is_blocked("refunds") and len(broker.asked) == 2, "the second wait is longer"
    clock.now += 0.6
    broker.states["refunds"] = TopicState.EXISTS
    assert not watch.is_blocked("refunds")
    assert watch.blocked_topics == frozenset()
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.WARNING, "topic refunds is missing"),
        (logging.WARNING, "topic refunds exists now, after 3 s missing"),
    ], "one line when blocked, one when back: none per retry"


def test_a_denied_topic_says_so_and_an_unanswered_question_keeps_what_was_known() -> None:
    broker, clock = _Broker(), _Clock()
    broker.states["ledger"] = TopicState.DENIED
    watch = _watch(broker, clock)
    assert watch.is_blocked("ledger")
    assert watch.state("ledger") is TopicState.DENIED
    broker.states["ledger"] = TopicState.UNKNOWN
    clock.now += 2
    assert watch.is_blocked("ledger"), "no answer does not unblock"
    assert watch.state("ledger") is TopicState.DENIED


def test_an_unanswered_first_question_does_not_block_and_is_asked_again_later() -> None:
    broker, clock = _Broker(), _Clock()
    broker.states["orders"] = TopicState.UNKNOWN
    watch = _watch(broker, clock)
    assert not watch.is_blocked("orders")
    assert not watch.is_blocked("orders") and broker.asked == ["orders"]
    clock.now += 1.0
    broker.states["orders"] = TopicState.MISSING
    assert watch.is_blocked("orders") and len(broker.asked) == 2


def test_a_delivery_report_blocks_a_known_topic_and_forget_asks_again() -> None:
    broker, clock = _Broker(), _Clock()
    broker.states["orders"] = TopicState.EXISTS
    watch = _watch(broker, clock)
    assert not watch.is_blocked("orders")
    watch.block("orders", TopicState.MISSING)
    assert watch.is_blocked("orders") and broker.asked == ["orders"]
    clock.now += 1.0
    assert not watch.is_blocked("orders"), "it exists again"
    watch.forget(["orders"])
    broker.states["orders"] = TopicState.MISSING
    assert watch.is_blocked("orders") and len(broker.asked) == 3


def test_delivery_errors_that_concern_the_topic() -> None:
    assert topic_error_state(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)) is TopicState.MISSING
    assert topic_error_state(KafkaError(KafkaError._UNKNOWN_TOPIC)) is TopicState.MISSING
    denied = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert topic_error_state(denied) is TopicState.DENIED
    assert topic_error_state(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)) is None
