"""Retention's drop against writers that race it, on real PostgreSQL: a row committed while the
drop waits for its lock keeps its partition whatever the default isolation level; a relay's
record committed between the outbox facts cannot lose a parked row (it is kept aside); a transaction
that writes into the outbox partition being dropped (a row with an old id, the idempotency key
of one of its rows) waits for the drop or the drop for it, and neither deadlocks; a relay
releasing a key while the drop keeps its rows aside waits for it and leaves no copy behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TypeVar

import pytest
import sqlalchemy as sa

from oncely import retention
from oncely.retention import maintenance
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import outbox, partitions, upgrade
from oncely.storage.errors import DuplicateEventError, translate_errors_of
from oncely.storage.stores.outbox import writes
from oncely.storage.stores.outbox.relay import Parking, RelayStore
from oncely.storage.tables import shard_of
from tests.helpers import (
    acknowledge_all,
    execute,
    insert_rows,
    outbox_row,
    park,
    scalar,
    uuid7_at,
    wait_until,
)

pytestmark = pytest.mark.integration

T = TypeVar("T")
STEP = timedelta(minutes=1)
POLICY = retention.policy_of(
    RetentionSettings(ahead=2, lock_timeout_seconds=10),
    RelaySettings(),
    outbox_horizon=STEP,
    receipts_horizon=STEP,
)


def _no_kafka(topics: Iterable[str]) -> retention.guard.KafkaAnswer:
    return {}  # no receipts partition is judged here: the outbox has only its own partitions


@pytest.fixture
def old(engine: sa.Engine) -> tuple[datetime, partitions.Partition]:
    """A moment three minutes ago and its outbox partition, the table's only closed one."""
    upgrade(engine, partition_every=STEP)
    now: datetime = scalar(engine, "SELECT now()")
    moment = now - 3 * STEP
    lower = partitions.window_start(moment, STEP)
    with engine.begin() as conn:
        partitions.create_partition(conn, "oncely_outbox", lower, lower + STEP)
        found = [p for p in partitions.partitions(conn, "oncely_outbox") if p.lower == lower]
    return moment, found[0]


def _rows_in(engine: sa.Engine, partition: partitions.Partition) -> int:
    low, high = partition.ids()
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM oncely_outbox WHERE id >= CAST(:l AS uuid)"
            " AND id < CAST(:h AS uuid)",
            l=str(low),
            h=str(high),
        )
    )


def _waiting(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM pg_locks WHERE NOT granted"))


@contextmanager
def _in_background(run: Callable[[], T]) -> Iterator[list[T]]:
    """Run ``run`` on a thread; its result lands in the yielded list once the block ends."""
    found: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            found.append(run())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    try:
        yield found
    finally:
        thread.join(60)
    if failed:
        raise failed[0]


def _wait_for_lock_wait(engine: sa.Engine) -> None:
    deadline = time.monotonic() + 20
    while _waiting(engine) == 0:
        assert time.monotonic() < deadline, "retention never waited for the writer's lock"
        time.sleep(0.02)


def _reasons(outcome: retention.Outcome) -> str:
    return " | ".join([*(str(v.reason) for v in outcome.kept), *outcome.errors])


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable", "read committed"])
def test_a_row_committed_during_the_lock_wait_keeps_its_partition_at_any_default_isolation(
    engine: sa.Engine,
    old: tuple[datetime, partitions.Partition],
    isolation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moment, partition = old
    database = scalar(engine, "SELECT quote_ident(current_database())")
    execute(engine, f"ALTER DATABASE {database} SET default_transaction_isolation = '{isolation}'")
    engine.dispose()  # new connections take the database's default
    seen: list[str] = []
    facts = maintenance.outbox_facts

    def observed(conn: sa.Connection, p: partitions.Partition) -> retention.guard.OutboxFacts:
        seen.append(conn.execute(sa.text("SHOW transaction_isolation")).scalar_one())
        return facts(conn, p)

    monkeypatch.setattr(maintenance, "outbox_facts", observed)
    late = outbox_row("t", "late", event_id=uuid7_at(moment))
    with engine.connect() as writer:
        writer.execute(sa.insert(outbox), [late])  # committed only once retention waits for it
        with _in_background(lambda: retention.run(engine, POLICY, _no_kafka)) as outcome:
            _wait_for_lock_wait(engine)
            writer.commit()
    assert partition.name not in outcome[0].dropped, outcome[0]
    assert _rows_in(engine, partition) == 1  # the late row is still there for the relay
    assert "has not passed all its rows" in _reasons(outcome[0])
    assert seen and set(seen) == {"read committed"}  # the plan and the re-check


def test_a_freeze_reads_nothing_before_its_lock(
    engine: sa.Engine, old: tuple[datetime, partitions.Partition]
) -> None:
    """At REPEATABLE READ the snapshot is the transaction's first query's: a freeze that ran
    one before its lock would not see a row committed during the wait."""
    moment, partition = old
    counted: list[int] = []

    def frozen_count() -> None:
        snapshot = engine.connect().execution_options(isolation_level="REPEATABLE READ")
        with snapshot as conn, conn.begin():
            partitions.freeze(conn, partition, timeout=10)
            low, high = partition.ids()
            counted.append(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM oncely_outbox"
                        " WHERE id >= CAST(:l AS uuid) AND id < CAST(:h AS uuid)"
                    ),
                    {"l": str(low), "h": str(high)},
                ).scalar_one()
            )

    with engine.connect() as writer:
        writer.execute(sa.insert(outbox), [outbox_row("t", "late", event_id=uuid7_at(moment))])
        with _in_background(frozen_count):
            _wait_for_lock_wait(engine)
            writer.commit()
    assert counted == [1]


def test_a_relay_record_between_the_facts_cannot_lose_a_parked_row(
    engine: sa.Engine, old: tuple[datetime, partitions.Partition], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan runs before a late row R commits; under the drop's lock the relay records its
    progress past R and R parked (delayed) in one transaction, between two of the re-check's
    statements. R is unpublished: the partition goes only with R kept aside for the relay."""
    moment, partition = old
    late = outbox_row("t", "late", event_id=uuid7_at(moment))
    unpassed = partitions.unpassed_shards
    calls: list[int] = []

    def racing(conn: sa.Connection, p: partitions.Partition) -> list[int]:
        calls.append(1)
        if len(calls) == 1:  # the plan's: R commits after the plan read the partition
            found = unpassed(conn, p)
            insert_rows(engine, [late])
            return found
        with engine.begin() as relay:  # the re-check's: the relay records R as parked
            park(relay, late, "delayed", until_seconds=3600)
            acknowledge_all(relay)
        return unpassed(conn, p)

    monkeypatch.setattr(partitions, "unpassed_shards", racing)
    outcome = retention.run(engine, POLICY, _no_kafka)
    assert len(calls) == 2
    assert partition.name in outcome.dropped, outcome
    assert scalar(engine, "SELECT id FROM oncely_relay_kept") == late["id"]


def test_a_row_with_an_old_id_staged_during_the_drop_neither_deadlocks_nor_is_lost(
    engine: sa.Engine, old: tuple[datetime, partitions.Partition]
) -> None:
    """A business transaction holds the outbox (it staged a current row) when retention comes
    to drop an old partition, then stages a row with an id in that partition (a client clock
    behind): it commits, the partition stays for the relay, and retention reports no
    deadlock."""
    moment, partition = old
    insert_rows(engine, [outbox_row("t", "published", event_id=uuid7_at(moment))])
    acknowledge_all(engine)
    with engine.connect() as writer:
        writer.execute(sa.insert(outbox), [outbox_row("t", "current")])
        with _in_background(lambda: retention.run(engine, POLICY, _no_kafka)) as outcome:
            _wait_for_lock_wait(engine)
            time.sleep(0.2)  # the drop waits for the writer
            writer.execute(sa.insert(outbox), [outbox_row("t", "old", event_id=uuid7_at(moment))])
            time.sleep(1.5)  # past deadlock_timeout: PostgreSQL would have found a cycle
            writer.commit()
    assert "has not passed all its rows" in _reasons(outcome[0])  # not a lock failure
    assert partition.name not in outcome[0].dropped, outcome[0]
    assert _rows_in(engine, partition) == 2
    acknowledge_all(engine)
    assert partition.name in retention.run(engine, POLICY, _no_kafka).dropped


def test_staging_the_key_of_a_row_being_dropped_neither_deadlocks_nor_loses_the_key(
    engine: sa.Engine, old: tuple[datetime, partitions.Partition]
) -> None:
    """A business transaction that holds the outbox stages the idempotency key of a published
    row of the partition retention is dropping: the key is still taken (DuplicateEventError)
    while the row exists, and free once the partition is dropped; no side deadlocks."""
    moment, partition = old
    keyed = outbox_row("t", "keyed", event_id=uuid7_at(moment), event_key="order-17")
    insert_rows(engine, [keyed])
    acknowledge_all(engine)
    with engine.connect() as writer:
        translate_errors_of(writer)
        writer.execute(sa.insert(outbox), [outbox_row("t", "current")])
        with _in_background(lambda: retention.run(engine, POLICY, _no_kafka)) as outcome:
            _wait_for_lock_wait(engine)
            time.sleep(0.2)
            again = outbox_row("t", "keyed", event_key="order-17")
            with pytest.raises(DuplicateEventError), writer.begin_nested():
                writes.add_rows(writer, [again])
            time.sleep(1.5)
            writer.commit()
    assert partition.name in outcome[0].dropped, outcome[0]
    insert_rows(engine, [outbox_row("t", "keyed", event_key="order-17")])  # the key is free


def test_a_key_released_while_retention_keeps_its_rows_aside_leaves_no_copy(
    engine: sa.Engine, old: tuple[datetime, partitions.Partition], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay releases a dead key (its row and the row held behind it published) while the
    drop copies them aside: the release waits for the drop, then deletes the copies with the
    key, so no copy is left for ever, and its idempotency key is free again."""
    moment, partition = old
    failed = outbox_row("t", "k", event_id=uuid7_at(moment), event_key="order-18")
    held = outbox_row("t", "k", event_id=uuid7_at(moment))
    insert_rows(engine, [failed, held])
    acknowledge_all(engine)
    park(engine, failed, "dead", held=[held])
    shard = shard_of("t", "k", 32)
    execute(
        engine, "UPDATE oncely_relay_shards SET owner = 'r', epoch = 1 WHERE shard = :s", s=shard
    )
    store = RelayStore(engine, owner="r")
    parking = Parking("t", "k", shard, failed["id"], "dead")
    position = scalar(engine, "SELECT max(position) FROM oncely_relay_held")
    drop = partitions.drop
    releases: list[threading.Thread] = []
    released: list[bool] = []

    def racing(conn: sa.Connection, p: partitions.Partition, *, timeout: float) -> None:
        # The rows are copied aside, not committed yet: the relay releases the key now.
        release = threading.Thread(
            target=lambda: released.append(store.unpark(parking, epoch=1, published_to=position))
        )
        release.start()
        releases.append(release)
        wait_until(lambda: _waiting(engine) > 0 or not release.is_alive(), timeout=20)
        drop(conn, p, timeout=timeout)

    monkeypatch.setattr(partitions, "drop", racing)
    outcome = retention.run(engine, POLICY, _no_kafka)
    releases[0].join(30)
    assert partition.name in outcome.dropped, outcome
    assert released == [True]
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_parked") == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_kept") == 0
    insert_rows(engine, [outbox_row("t", "k", event_key="order-18")])  # the key is free
