"""The relay's metrics (one place for each) and its signals."""

from __future__ import annotations

import threading
import uuid

import pytest
from prometheus_client import CollectorRegistry

from oncely.relay.meters import Meters
from oncely.relay.shards import InFlight, Page
from oncely.relay.signals import Signal, Signals
from oncely.relay.transactions import Ended, Outcome
from oncely.runtime.metrics import RelayMetrics
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
from oncely.wire import ProgressRecord
from tests.unit.relay_fakes import FakeStore, guard

END = Progress(Snapshot(1, 1, frozenset()))


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_confirmations_are_counted_once_per_flush_per_topic_and_shard() -> None:
    registry = CollectorRegistry()
    meters = Meters(RelayMetrics(registry), None)
    rows = [OutboxRow(str(uuid.uuid4()), i, 2, "t", "k", "e", b"", (), 0) for i in range(3)]
    meters.acknowledged(Page(2, END, InFlight(), produced=rows))
    assert _value(registry, "oncely_relay_published_total", topic="t") == 0
    meters.flush()
    meters.flush()
    assert _value(registry, "oncely_relay_published_total", topic="t") == 3
    assert _value(registry, "oncely_relay_shard_published_total", shard="2") == 3
    assert _value(registry, "oncely_relay_publish_latency_seconds_count") == 1


def test_signals_say_what_the_relay_did_and_a_wait_times_out() -> None:
    signals = Signals()
    meters = Meters(RelayMetrics(CollectorRegistry()), signals)
    mark = signals.mark()
    threading.Timer(0.05, meters.replayed, args=(3,)).start()
    assert signals.wait_for(Signal.REPLAYED, shard=3, after=mark, timeout=5).shards == {3}
    meters.took([ShardProgress(1, 1, END)])
    assert [e.signal for e in signals.events()] == [Signal.REPLAYED, Signal.TOOK]
    with pytest.raises(TimeoutError, match="no lost event"):
        signals.wait_for(Signal.LOST, timeout=0.01)


def test_the_backlog_is_read_only_while_rows_are_read_or_some_were_left() -> None:
    store, meters = FakeStore(), Meters(RelayMetrics(CollectorRegistry()), None)
    shards = frozenset({0, 1})
    meters.read_gauges(store, shards, any_blocked=False, db=guard)  # once at the start
    assert store.backlog_reads == 1
    meters.read_gauges(store, shards, any_blocked=False, db=guard)  # none left, none read
    assert store.backlog_reads == 1
    meters.rows_read(3)
    meters.read_gauges(store, shards, any_blocked=False, db=guard)
    assert store.backlog_reads == 2


def _record(shard: int, after_seq: int) -> ProgressRecord:
    return ProgressRecord(shard, 1, "1:1:", None, after_seq)


def _at(shard: int, after_seq: int) -> ShardProgress:
    return ShardProgress(shard, 1, Progress(Snapshot(1, 1, frozenset()), None, after_seq))


def test_transactions_are_counted_by_outcome_and_timed_only_in_exactly_once_mode() -> None:
    registry = CollectorRegistry()
    meters = Meters(RelayMetrics(registry), None, exactly_once=True)
    for outcome in Outcome:
        assert (
            registry.get_sample_value("oncely_relay_transactions_total", {"outcome": outcome.value})
            == 0
        )
    meters.transactions(
        [
            Ended(1, Outcome.COMMITTED, 0.02, _record(1, 5)),
            Ended(1, Outcome.ABORTED, 0.5),
            Ended(2, Outcome.FENCED, 0.1),
            Ended(2, Outcome.COMMITTED, 0.03, _record(2, 1)),
        ]
    )
    assert _value(registry, "oncely_relay_transactions_total", outcome="committed") == 2
    assert _value(registry, "oncely_relay_transactions_total", outcome="aborted") == 1
    assert _value(registry, "oncely_relay_transactions_total", outcome="fenced") == 1
    assert _value(registry, "oncely_relay_transactions_total", outcome="failed") == 0
    assert _value(registry, "oncely_relay_transaction_seconds_count") == 4
    assert _value(registry, "oncely_relay_transaction_seconds_bucket", le="0.05") == 2

    at_least_once = CollectorRegistry()
    meters = Meters(RelayMetrics(at_least_once), None)
    meters.transactions(())
    meters.read_gauges(FakeStore(), frozenset({0, 1}), any_blocked=False, db=guard)
    names = {sample.name for family in at_least_once.collect() for sample in family.samples}
    assert "oncely_relay_transactions_total" not in names
    assert "oncely_relay_progress_lag_seconds" not in names
    assert _value(at_least_once, "oncely_relay_transaction_seconds_count") == 0


def test_the_progress_lag_is_the_age_of_the_oldest_commit_postgresql_has_not_recorded() -> None:
    registry, now = CollectorRegistry(), [100.0]
    meters = Meters(RelayMetrics(registry), None, exactly_once=True, clock=lambda: now[0])
    store, held = FakeStore(), {1, 2}

    def lag(shard: int) -> float | None:
        meters.read_gauges(store, frozenset(held), any_blocked=False, db=guard)
        return registry.get_sample_value("oncely_relay_progress_lag_seconds", {"shard": str(shard)})

    assert lag(1) == 0 and lag(2) == 0
    meters.transactions([Ended(1, Outcome.COMMITTED, 0.01, _record(1, 5))])
    now[0] = 103.0
    meters.transactions([Ended(1, Outcome.COMMITTED, 0.01, _record(1, 9))])
    meters.transactions([Ended(1, Outcome.ABORTED, 0.01)])  # no position: nothing to record
    now[0] = 110.0
    assert lag(1) == 10.0 and lag(2) == 0
    meters.recorded([_at(1, 5)])  # the first commit only
    assert lag(1) == 7.0
    meters.recorded([_at(2, 1), _at(1, 9)])
    assert lag(1) == 0

    meters.transactions([Ended(3, Outcome.COMMITTED, 0.01, _record(3, 1))])  # shard 3 was lost
    now[0] = 200.0
    assert lag(3) is None
    held.add(3)
    assert lag(3) == 0  # taken again: the commit reported while it was lost does not count
    meters.transactions([Ended(2, Outcome.COMMITTED, 0.01, _record(2, 2))])
    meters.forget(2)
    assert registry.get_sample_value("oncely_relay_progress_lag_seconds", {"shard": "2"}) is None
    now[0] = 230.0
    assert lag(2) == 0  # held again: nothing of before is waiting
