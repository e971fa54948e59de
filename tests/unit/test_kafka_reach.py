"""A Kafka outage told in two lines (:mod:`oncely.runtime.reach`), on a fake clock: what is
told, what is counted, and when the brokers count as back."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from confluent_kafka import KafkaError

from oncely.runtime.reach import QUIET, KafkaReach

ALL_DOWN = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
REFUSED = KafkaError(KafkaError._TRANSPORT, "b:9092/1: Connect to ipv4#b:9092 failed")
AUTH = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error")
FATAL = KafkaError(KafkaError._FENCED, "fenced", fatal=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Logger:
    """A client's own ``logger``: what reached it."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)


class Client:
    """What a Kafka client does with the configuration that :meth:`KafkaReach.client_config`
    gives it: its log lines, errors and statistics go to the callbacks."""

    def __init__(self, reach: KafkaReach, **config: Any) -> None:
        self.errors: list[KafkaError] = []
        self.logger = Logger()
        self.config = reach.client_config(
            {"logger": self.logger, "error_cb": self.errors.append, **config}
        )

    def line(self, facility: str, text: str) -> None:
        self.config["logger"].log(logging.ERROR, "%s [%s] %s", facility, "rdkafka#producer-1", text)

    def error(self, error: KafkaError) -> None:
        self.config["error_cb"](error)

    def statistics(self, *states: str) -> None:
        brokers = {f"b:9092/{i}": {"state": state} for i, state in enumerate(states)}
        self.config["stats_cb"](json.dumps({"name": "rdkafka#producer-1", "brokers": brokers}))


def _told(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "oncely.runtime.reach"]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reach(clock: Clock, caplog: pytest.LogCaptureFixture) -> KafkaReach:
    caplog.set_level(logging.INFO, logger="oncely.runtime.reach")
    return KafkaReach(clock=clock)


def test_an_outage_is_one_warning_then_one_line_with_the_count_and_its_length(
    reach: KafkaReach, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(reach)
    client.line("FAIL", "b:9092/1: Connect to ipv4#b:9092 failed: Connection refused")
    assert len(client.logger.lines) == 1, "before the outage a line passes"
    client.error(ALL_DOWN)
    [unreachable] = _told(caplog)
    assert unreachable.levelno == logging.WARNING
    assert unreachable.getMessage() == (
        "Kafka brokers unreachable (1/1 brokers are down; last: b:9092/1: Connect to ipv4#b:9092"
        " failed: Connection refused): the clients keep retrying; their lines are counted, not"
        " logged, until a broker answers"
    )
    assert reach.down
    for _ in range(100):  # librdkafka's retries, each a line and an error
        clock.now += 0.1
        client.line("FAIL", "b:9092/1: Connect to ipv4#b:9092 failed: Connection refused")
        client.error(REFUSED)
    client.error(ALL_DOWN)  # said again every 10 s
    client.statistics("INIT")
    assert len(client.logger.lines) == 1 and client.errors == [], "counted, not passed on"
    assert len(_told(caplog)) == 1
    clock.now += 1
    client.statistics("INIT", "UP")  # a broker answers at 111.0
    clock.now += QUIET
    client.statistics("UP")
    [_, back] = _told(caplog)
    assert back.levelno == logging.INFO
    assert back.getMessage() == (
        "Kafka brokers reachable again after 11.0 s; 201 librdkafka lines and client errors"
        " were not logged"
    )
    assert (back.__dict__["outage_seconds"], back.__dict__["not_logged"]) == (11.0, 201)
    assert not reach.down
    client.line("FAIL", "b:9092/2: Disconnected")
    client.error(REFUSED)
    assert len(client.logger.lines) == 2 and client.errors == [REFUSED], "they pass again"


def test_a_failure_reported_after_a_broker_answered_restarts_the_quiet_wait(
    reach: KafkaReach, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A client polled now and then serves news of the outage late: not a new outage, and
    not back until no client reports a failure for QUIET seconds."""
    fresh, late = Client(reach), Client(reach)
    fresh.error(ALL_DOWN)
    clock.now += 20
    fresh.statistics("UP")
    clock.now += QUIET - 1
    late.line("FAIL", "b:9092/bootstrap: Connect to ipv4#b:9092 failed: Connection refused")
    late.error(ALL_DOWN)
    clock.now += 1
    fresh.statistics("UP")
    assert reach.down and len(_told(caplog)) == 1, "no line: still waiting"
    reach.reached()  # an acknowledged record, as good as a broker up in the statistics
    clock.now += QUIET
    reach.reached()
    assert not reach.down
    [_, back] = _told(caplog)
    assert back.getMessage().startswith("Kafka brokers reachable again after 25.0 s; 2 ")


def test_lines_of_other_facilities_while_down_are_counted_but_do_not_delay_the_recovery(
    reach: KafkaReach, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(reach)
    client.error(ALL_DOWN)
    client.statistics("UP")
    clock.now += QUIET
    client.line("REQTMOUT", "Timed out 1 in-flight request")
    client.statistics("UP")
    assert not reach.down
    assert client.logger.lines == []
    assert _told(caplog)[-1].__dict__["not_logged"] == 1


def test_refused_credentials_and_fatal_errors_go_on_to_the_client_during_an_outage(
    reach: KafkaReach,
) -> None:
    """The relay and the consumers stop on them: an outage must not hide them."""
    client = Client(reach)
    client.error(ALL_DOWN)
    client.error(AUTH)
    client.error(FATAL)
    assert client.errors == [AUTH, FATAL]


def test_each_outage_is_told_and_counted_on_its_own(
    reach: KafkaReach, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(reach)
    for _ in range(2):
        client.error(ALL_DOWN)
        client.error(REFUSED)
        clock.now += 3
        client.statistics("UP")
        clock.now += QUIET
        client.statistics("UP")
    messages = [r.getMessage() for r in _told(caplog)]
    assert [m.split(" (")[0].split(";")[0] for m in messages] == [
        "Kafka brokers unreachable",
        "Kafka brokers reachable again after 3.0 s",
        "Kafka brokers unreachable",
        "Kafka brokers reachable again after 3.0 s",
    ]
    assert [r.__dict__.get("not_logged") for r in _told(caplog)] == [None, 1, None, 1]


def test_the_unreachable_line_names_a_recent_failure_only(
    reach: KafkaReach, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(reach)
    client.error(REFUSED)
    assert client.errors == [REFUSED], "before the outage an error passes"
    clock.now += 3600  # a broker dropped an idle connection an hour ago
    client.error(ALL_DOWN)
    assert "(1/1 brokers are down)" in _told(caplog)[0].getMessage()


def test_a_client_reports_its_brokers_every_5_s_unless_configured_otherwise() -> None:
    reach = KafkaReach()
    assert reach.client_config({})["statistics.interval.ms"] == 5000
    assert reach.client_config({"statistics.interval.ms": 1000})["statistics.interval.ms"] == 1000
