"""A quiet relay waits for a NOTIFY instead of polling its database; a busy one polls and
staging sends no NOTIFY (real PostgreSQL and Kafka)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from tests.helpers import (
    StatementSpy,
    count_published,
    fast_settings,
    insert_rows,
    outbox_rows,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration


def _asleep(engine: sa.Engine) -> bool:
    return bool(scalar(engine, "SELECT bool_or(asleep) FROM oncely_relay_members"))


def test_a_quiet_relay_wakes_on_a_commit_and_is_nearly_silent_while_idle(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = new_topic()
    statements = StatementSpy(monkeypatch)
    # A fallback read a minute away: only the NOTIFY can publish a row within seconds.
    settings = fast_settings(poll_interval_seconds=60.0, lease_seconds=6.0)
    with running_relay(engine, kafka_bootstrap, settings):
        wait_until(lambda: _asleep(engine), timeout=15)
        for n in range(1, 4):
            committed = time.monotonic()
            insert_rows(engine, outbox_rows(1, topics=[topic], keys=1))
            wait_until(lambda n=n: count_published(engine) == n, timeout=20, interval=0.02)
            assert time.monotonic() - committed < 3.0, "the relay was not woken by the commit"
        time.sleep(3.0)  # its progress recorded
        before = len(statements)
        time.sleep(20.0)
        idle = (len(statements) - before) / 20.0
    assert idle <= 1.0, f"an idle relay sent {idle:.2f} statements/s to its database"


def test_a_busy_relay_polls_and_staging_stops_notifying(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    inserted = 0
    with running_relay(engine, kafka_bootstrap, fast_settings(batch_size=1000)):
        wait_until(lambda: _asleep(engine), timeout=15)
        for _ in range(40):
            insert_rows(engine, outbox_rows(2_000, topics=[topic], keys=50))
            inserted += 2_000
            time.sleep(0.1)
            if not _asleep(engine):
                break
        else:
            pytest.fail("20,000 rows/s did not switch the relay to polling")
        wait_until(lambda: count_published(engine) == inserted, timeout=60)
        wait_until(lambda: _asleep(engine), timeout=15)


@pytest.mark.parametrize("configured", [False, True])
def test_a_quiet_relay_sends_a_reads_records_at_once_unless_linger_is_configured(
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    configured: bool,
) -> None:
    """linger.ms unset: a busy relay's records linger (here 3 s, so that it shows), a quiet
    relay's go out when read; ``linger_ms`` given: it holds while quiet too."""
    monkeypatch.setattr("oncely.relay.service.BUSY_LINGER_MS", 3000)
    topic = new_topic()
    overrides = {"linger_ms": 3000} if configured else {}
    settings = fast_settings(poll_interval_seconds=60.0, **overrides)
    with running_relay(engine, kafka_bootstrap, settings):
        wait_until(lambda: _asleep(engine), timeout=15)
        # The first record of a topic waits for its metadata, past the flush: not measured.
        insert_rows(engine, outbox_rows(1, topics=[topic], keys=1))
        wait_until(lambda: count_published(engine) == 1, timeout=20, interval=0.01)
        committed = time.monotonic()
        insert_rows(engine, outbox_rows(1, topics=[topic], keys=1))
        wait_until(lambda: count_published(engine) == 2, timeout=20, interval=0.01)
        seconds = time.monotonic() - committed
    if configured:
        assert seconds >= 2.5, f"published after {seconds:.2f} s despite linger.ms=3000"
    else:
        assert seconds < 1.0, f"a quiet relay's record lingered {seconds:.2f} s"
