"""The relay's loop on fakes (:mod:`tests.unit.relay_fakes`): the decisions of its parts applied
in the right order, turn by turn on a fake clock, and what delivery reports lead to
(:mod:`oncely.relay.outcomes`: records, replays, dead letters, releases, hand-offs). The same
guarantees are tested against real PostgreSQL and Kafka in tests/integration/test_relay*.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from confluent_kafka import KafkaError

from oncely.relay.signals import Signal
from oncely.relay.transactions import Ended, Outcome
from tests.unit.relay_fakes import Loop, loop


def _recorded(relay_loop: Loop, shard: int) -> bool:
    """Whether ``shard``'s recorded progress has every staged row of it behind it."""
    lease = relay_loop.store.leases[shard]
    done = lease.progress.done
    return all(done.visible(txid) for txid, row in relay_loop.store.outbox if row.shard == shard)


def test_rows_go_out_in_commit_order_per_key_and_progress_is_recorded_after() -> None:
    relay_loop = loop(shards=2)
    rows = [relay_loop.store.stage(i % 2, f"k{i % 3}") for i in range(30)]
    relay_loop.run_until(lambda: len(relay_loop.publisher.sent) == 30)
    assert relay_loop.published() == [row.event_id for row in rows]
    assert _recorded(relay_loop, 0) and _recorded(relay_loop, 1)
    assert relay_loop.store.leases[0].owner is None  # given back at the drain
    took = relay_loop.signals.events(Signal.TOOK)
    assert took and took[0].shards == {0, 1}


def test_a_failure_costs_only_its_shard() -> None:
    relay_loop = loop(shards=2)
    store, publisher = relay_loop.store, relay_loop.publisher
    bad = store.stage(0, "a")
    good = [store.stage(1, "b") for _ in range(5)]
    publisher.failing[bad.event_id] = KafkaError.INVALID_RECORD
    relay_loop.run_until(lambda: len(relay_loop.signals.events(Signal.REPLAYED)) >= 1)
    replays = relay_loop.signals.events(Signal.REPLAYED)
    assert {shard for event in replays for shard in event.shards} == {0}
    assert [r.event_id for r in publisher.sent] == [r.event_id for r in good]
    assert _recorded(relay_loop, 1)
    assert not _recorded(relay_loop, 0)


def test_a_row_failing_for_good_is_dead_lettered_and_parks_its_key_and_holds_the_next() -> None:
    relay_loop = loop(shards=1, max_attempts=2)
    store, publisher = relay_loop.store, relay_loop.publisher
    bad = store.stage(0, "a")
    after = store.stage(0, "a")
    other = store.stage(0, "b")
    publisher.failing[bad.event_id] = KafkaError.INVALID_RECORD
    relay_loop.run_until(lambda: _recorded(relay_loop, 0))
    parking = store.parkings[("orders", "a")]
    assert parking.reason == "dead" and parking.event_id == bad.id
    assert [e for _, e in store.held[("orders", "a")]] == [after.id]
    assert other.event_id in relay_loop.published()  # copies of the first read are duplicates
    assert bad.event_id not in relay_loop.published()
    assert relay_loop.metrics.dead.labels("orders")._value.get() == 1


def test_a_released_key_publishes_its_rows_in_order_then_unparks() -> None:
    relay_loop = loop(shards=1, max_attempts=1)
    store, publisher = relay_loop.store, relay_loop.publisher
    bad = store.stage(0, "a")
    after = store.stage(0, "a")
    publisher.failing[bad.event_id] = KafkaError.INVALID_RECORD

    def requeue() -> None:
        del publisher.failing[bad.event_id]
        store.due(("orders", "a"))  # an operator's `oncely dead requeue`

    relay_loop.run(
        (lambda: ("orders", "a") in store.parkings and _recorded(relay_loop, 0), requeue),
        (lambda: ("orders", "a") not in store.parkings, None),
    )
    assert relay_loop.published()[-2:] == [bad.event_id, after.event_id]
    assert relay_loop.signals.events(Signal.RELEASED)


def test_a_delayed_row_parks_its_key_until_it_is_due() -> None:
    relay_loop = loop(shards=1)
    store = relay_loop.store
    later = datetime.now(UTC) + timedelta(hours=1)
    delayed = store.stage(0, "a", available_at=later)
    behind = store.stage(0, "a")
    free = store.stage(0, "b")
    relay_loop.run_until(lambda: _recorded(relay_loop, 0))
    assert relay_loop.published() == [free.event_id]
    assert store.parkings[("orders", "a")].reason == "delayed"
    assert [e for _, e in store.held[("orders", "a")]] == [behind.id]
    assert delayed.id == store.parkings[("orders", "a")].event_id


def test_a_shard_taken_over_is_forgotten_and_its_progress_is_not_written() -> None:
    relay_loop = loop(shards=2)
    store = relay_loop.store
    store.stage(0, "a")
    records: list[int] = []

    def take_over() -> None:
        store.stage(1, "b")
        store.take_over(1)
        records.append(len(store.records))

    relay_loop.run(
        (lambda: len(relay_loop.publisher.sent) == 1, take_over),
        (lambda: bool(relay_loop.signals.events(Signal.LOST)), None),
    )
    assert relay_loop.signals.events(Signal.LOST)[0].shards == {1}
    assert all(p.shard != 1 for batch in store.records[records[0] :] for p in batch)
    assert relay_loop.metrics.lease_lost._value.get() == 1


def test_over_its_share_a_relay_hands_shards_off_after_recording_them() -> None:
    relay_loop = loop(shards=4)
    store = relay_loop.store
    for shard in range(4):
        store.stage(shard, "k")

    def second_relay_joins() -> None:
        store.alive = 2  # the share is 2 now
        relay_loop.clock.advance(4)  # the next heartbeat

    relay_loop.run(
        (lambda: len(relay_loop.publisher.sent) == 4, second_relay_joins),
        (lambda: len(relay_loop.relay.shards) == 2, None),
    )
    handed = relay_loop.signals.events(Signal.HANDED_OFF)
    assert handed[0].shards == {2, 3}  # the highest numbers first
    assert _recorded(relay_loop, 2) and _recorded(relay_loop, 3)
    assert store.leases[2].owner is None and store.leases[3].owner is None


def test_a_database_failure_sets_a_retry_time_and_the_loop_serves_reports_meanwhile() -> None:
    relay_loop = loop(shards=1)
    store, clock, relay = relay_loop.store, relay_loop.clock, relay_loop.relay
    store.stage(0, "a")
    seen: dict[str, float] = {}

    def fail_the_next_read() -> None:
        store.stage(0, "b")
        store.fail["read"] = 1
        seen["failed_at"] = clock.now

    def not_ready() -> None:
        seen["ready"] = relay.ready()

    relay_loop.run(
        (lambda: len(relay_loop.publisher.sent) == 1, fail_the_next_read),
        (lambda: not relay.database_ok, not_ready),
        (lambda: len(relay_loop.publisher.sent) == 2, None),
    )
    assert seen["ready"] is False
    assert relay.database_ok
    assert clock.now - seen["failed_at"] >= 0.2  # read again only after the retry time


def test_progress_cannot_be_recorded_so_every_shard_replays_without_loss() -> None:
    relay_loop = loop(shards=2)
    store = relay_loop.store
    rows = [store.stage(i % 2, f"k{i}") for i in range(4)]
    store.fail["record"] = 1
    relay_loop.run_until(lambda: _recorded(relay_loop, 0) and _recorded(relay_loop, 1))
    replayed = {s for event in relay_loop.signals.events(Signal.REPLAYED) for s in event.shards}
    assert replayed == {0, 1}
    assert set(relay_loop.published()) == {row.event_id for row in rows}  # duplicates, no loss


def test_a_missing_topic_blocks_only_its_keys_and_they_go_out_once_it_exists() -> None:
    relay_loop = loop(shards=1)
    store, publisher = relay_loop.store, relay_loop.publisher
    publisher.missing_topics.add("invoices")
    blocked = store.stage(0, "a", topic="invoices")
    free = store.stage(0, "b")
    relay_loop.run(
        (lambda: _recorded(relay_loop, 0), lambda: None),
        (
            lambda: store.parkings[("invoices", "a")].reason == "blocked",
            publisher.missing_topics.clear,
        ),
        (lambda: ("invoices", "a") not in store.parkings, None),
    )
    assert relay_loop.published() == [free.event_id, blocked.event_id]


def test_drain_waits_for_reports_records_and_gives_every_shard_back() -> None:
    relay_loop = loop(shards=3)
    store = relay_loop.store
    for shard in range(3):
        store.stage(shard, "k")
    relay_loop.run_until(lambda: len(relay_loop.publisher.sent) == 3)
    assert all(lease.owner is None for lease in store.leases.values())
    assert all(_recorded(relay_loop, shard) for shard in range(3))
    assert relay_loop.relay.shards == frozenset()


def test_the_transactions_the_publisher_reports_ended_are_counted() -> None:
    relay_loop = loop(shards=2, exactly_once=True)
    publisher, registry = relay_loop.publisher, relay_loop.metrics.registry

    def fenced() -> None:
        publisher.ending.append(Ended(1, Outcome.FENCED, 0.25))

    relay_loop.run(
        (lambda: bool(relay_loop.signals.events(Signal.TOOK)), fenced),
        (lambda: not publisher.ending, None),
    )
    counted = registry.get_sample_value("oncely_relay_transactions_total", {"outcome": "fenced"})
    assert counted == 1
    assert registry.get_sample_value("oncely_relay_transaction_seconds_sum") == 0.25
