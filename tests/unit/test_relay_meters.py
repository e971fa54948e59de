"""The relay's metrics (one place for each) and its signals."""

from __future__ import annotations

import threading
import uuid

import pytest
from prometheus_client import CollectorRegistry

from oncely.relay.meters import Meters
from oncely.relay.shards import InFlight, Page
from oncely.relay.signals import Signal, Signals
from oncely.runtime.metrics import RelayMetrics
from oncely.storage.stores.outbox.relay import Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
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
