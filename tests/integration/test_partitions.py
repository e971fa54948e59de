"""The partitioned layout (``oncely db upgrade --partition-every``): the conversion keeps every
row, the relay's progress and the grants; ids route to their step's partition; the outbox's
idempotency key stays unique across partitions; receipts stay unique per (event, effect)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from oncely.storage import partitions, upgrade
from oncely.storage.errors import DuplicateEventError, translate_errors_of
from oncely.storage.stores.outbox import writes
from tests.helpers import (
    acknowledge_all,
    fast_settings,
    insert_rows,
    outbox_row,
    query_all,
    read_topics,
    running_relay,
    scalar,
    uuid7_at,
    wait_until,
)

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)


def test_conversion_keeps_rows_seq_and_txid(engine: sa.Engine) -> None:
    now = datetime.now(UTC)
    old = [
        outbox_row("t", f"k{i}", event_id=uuid7_at(now - timedelta(minutes=5 * i)))
        for i in range(4)
    ]
    old.append(outbox_row("t", "v4", event_id=uuid.uuid4()))  # to the default partition
    insert_rows(engine, old)
    before = query_all(engine, "SELECT id, seq, txid::text, shard FROM oncely_outbox ORDER BY id")
    upgrade(engine, partition_every=STEP)
    after = query_all(engine, "SELECT id, seq, txid::text, shard FROM oncely_outbox ORDER BY id")
    assert before == after
    with engine.connect() as conn:
        names = [p.name for p in partitions.partitions(conn, "oncely_outbox")]
        assert partitions.step_of(conn) == STEP
    assert names[-1] == "oncely_outbox_default"
    assert len(names) >= 4 + 3
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox_default") == 1
    upgrade(engine, partition_every=STEP)  # twice: a no-op
    seq = scalar(engine, "SELECT max(seq) FROM oncely_outbox")
    insert_rows(engine, [outbox_row("t", "new", event_id=uuid7_at(now))])
    assert scalar(engine, "SELECT max(seq) FROM oncely_outbox") > seq


def test_idempotency_key_is_unique_across_partitions(engine: sa.Engine) -> None:
    upgrade(engine, partition_every=STEP)
    now = datetime.now(UTC)
    insert_rows(
        engine, [outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=2)), event_key="k")]
    )
    row = outbox_row("t", event_id=uuid7_at(now), event_key="k")
    with engine.begin() as conn:
        translate_errors_of(conn)
        with pytest.raises(DuplicateEventError, match="idempotency_key"):
            writes.add_rows(conn, [row])


def test_a_key_equal_to_an_earlier_events_id_is_refused_across_partitions(
    engine: sa.Engine,
) -> None:
    """Rows keyed by their own id skip the cross-partition check: a later row may not take such
    a key."""
    upgrade(engine, partition_every=STEP)
    now = datetime.now(UTC)
    earlier = outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=2)))
    insert_rows(engine, [earlier])
    later = outbox_row("t", event_id=uuid7_at(now), event_key=str(earlier["id"]))
    with engine.begin() as conn:
        translate_errors_of(conn)
        with pytest.raises(DuplicateEventError):
            writes.add_rows(conn, [later])


def test_concurrent_stagings_of_one_key_in_two_partitions_commit_one(engine: sa.Engine) -> None:
    """The keys table's unique index makes the second wait for the first, then refuses it."""
    upgrade(engine, partition_every=STEP)
    now = datetime.now(UTC)
    first = outbox_row("t", event_id=uuid7_at(now - timedelta(minutes=2)), event_key="k")
    second = outbox_row("t", event_id=uuid7_at(now), event_key="k")
    outcome: list[BaseException | None] = []
    with engine.connect() as holder:
        holder.begin()
        writes.add_rows(holder, [first])

        def stage_second() -> None:
            try:
                with engine.begin() as conn:
                    translate_errors_of(conn)
                    writes.add_rows(conn, [second])
                outcome.append(None)
            except DuplicateEventError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=stage_second)
        thread.start()
        thread.join(timeout=1.0)
        assert thread.is_alive(), "the second staging did not wait for the first"
        holder.commit()
    thread.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], DuplicateEventError)
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox WHERE event_key = 'k'") == 1


def test_rows_pending_at_conversion_are_published_once_and_acknowledged_ones_not_again(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    now = datetime.now(UTC)
    done = [outbox_row(topic, f"k{i}", event_id=uuid7_at(now)) for i in range(10)]
    insert_rows(engine, done)
    acknowledge_all(engine)
    pending = [
        outbox_row(topic, f"k{i % 3}", event_id=uuid7_at(now - timedelta(minutes=i)))
        for i in range(10)
    ]
    insert_rows(engine, pending)
    upgrade(engine, partition_every=STEP)
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: len(read_topics(kafka_bootstrap, [topic])) >= len(pending), timeout=60)
        time.sleep(1.0)  # a relay that would publish acknowledged rows has had the time to
    copies = Counter(r.headers["id"].decode() for r in read_topics(kafka_bootstrap, [topic]))
    assert copies == Counter(str(row["id"]) for row in pending)


def test_conversion_keeps_the_outbox_in_its_publications_published_via_the_root(
    engine: sa.Engine,
) -> None:
    """A Debezium publication made before the conversion still streams the outbox, as
    ``oncely_outbox`` rows (dropping the old table would have taken it out of the publication)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE PUBLICATION conv_named FOR TABLE oncely_outbox")
        conn.exec_driver_sql("CREATE PUBLICATION conv_all FOR ALL TABLES")
    try:
        upgrade(engine, partition_every=STEP)
        rows = query_all(
            engine,
            "SELECT p.pubname, p.pubviaroot, array_agg(t.tablename::text ORDER BY t.tablename)"
            " AS tables FROM pg_publication p JOIN pg_publication_tables t USING (pubname)"
            " WHERE p.pubname LIKE 'conv_%' AND t.tablename ~ '^oncely_outbox($|_p|_default)'"
            " GROUP BY 1, 2 ORDER BY 1",
        )
        assert [tuple(row) for row in rows] == [
            ("conv_all", True, ["oncely_outbox"]),
            ("conv_named", True, ["oncely_outbox"]),
        ]
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP PUBLICATION conv_named, conv_all")


def test_a_converted_empty_outbox_numbers_its_first_row_1(engine: sa.Engine) -> None:
    """As an unpartitioned outbox does: `oncely replay --from-outbox` reads a first seq above 1
    as rows purged before the window."""
    upgrade(engine, partition_every=STEP)
    insert_rows(engine, [outbox_row("t", "k", event_id=uuid7_at(datetime.now(UTC)))])
    insert_rows(engine, [outbox_row("t", "k", event_id=uuid7_at(datetime.now(UTC)))])
    assert [r.seq for r in query_all(engine, "SELECT seq FROM oncely_outbox ORDER BY seq")] == [
        1,
        2,
    ]


def test_a_key_is_free_again_once_its_row_is_purged_or_its_partition_dropped(
    engine: sa.Engine,
) -> None:
    """As with the unpartitioned outbox's unique constraint: the key of a deleted row (the
    relay's or Debezium mode's purge) or of a dropped partition's row may be staged again."""
    upgrade(engine, partition_every=STEP)
    now = datetime.now(UTC)
    insert_rows(engine, [outbox_row("t", event_id=uuid7_at(now), event_key="purged")])
    with engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM oncely_outbox WHERE event_key = 'purged'")
    insert_rows(engine, [outbox_row("t", event_id=uuid7_at(now), event_key="purged")])
    old = now - timedelta(minutes=3)
    with engine.begin() as conn:
        start = partitions.window_start(old, STEP)
        partitions.create_partition(conn, "oncely_outbox", start, start + STEP)
    insert_rows(engine, [outbox_row("t", event_id=uuid7_at(old), event_key="dropped")])
    with engine.begin() as conn:
        [partition] = [
            p
            for p in partitions.partitions(conn, "oncely_outbox")
            if p.lower is not None and p.lower <= old < p.upper  # type: ignore[operator]
        ]
        partitions.drop(conn, partition, timeout=2)
    insert_rows(engine, [outbox_row("t", event_id=uuid7_at(now), event_key="dropped")])
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox_keys") == 2
    with pytest.raises(sa.exc.IntegrityError, match="oncely_outbox_event_key_key"):
        insert_rows(engine, [outbox_row("t", event_id=uuid7_at(now), event_key="dropped")])
