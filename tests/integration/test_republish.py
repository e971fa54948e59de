"""`oncely replay --from-outbox` against real Kafka and PostgreSQL: the relay's records again.

The window's rows are produced straight to Kafka through the relay's record path: the copies
carry the same event ids, keys, values and headers, in seq order per key. A window with purged
rows, a parked key, or rows not yet published is refused, naming why; on partitioned tables,
rows are purged when the window starts before the oldest range partition retention left.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from oncely.ops.republish import RepublishError, plan_republish
from oncely.storage import partitions, upgrade
from oncely.storage.stores.outbox.relay import RelayStore
from oncely.storage.tables import shard_of
from tests.helpers import (
    CliResult,
    Record,
    count_published,
    fast_settings,
    insert_rows,
    oncely_cli,
    outbox_rows,
    read_committed,
    read_topics,
    running_relay,
    scalar,
    uuid7_at,
    wait_until,
)

pytestmark = pytest.mark.integration


def _cli(*args: str) -> CliResult:
    return oncely_cli("replay", *args)


def _ids(records: list[Record]) -> list[str]:
    return [r.headers["id"].decode() for r in records]


def _published(
    engine: sa.Engine,
    kafka_bootstrap: str,
    rows: list[dict[str, object]],
    relay_mode: dict[str, object] | None = None,
) -> None:
    insert_rows(engine, rows)
    with running_relay(engine, kafka_bootstrap, fast_settings(**(relay_mode or {}))):
        wait_until(lambda: count_published(engine) == len(rows), timeout=60)


def test_the_window_is_republished_with_the_same_records_in_seq_order(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    relay_mode: dict[str, object],
) -> None:
    """Whichever mode published the rows: the copies are produced outside any transaction, and
    a ``read_committed`` consumer reads them after the originals."""
    topic = new_topic(partitions=3)
    rows = outbox_rows(60, topics=[topic], keys=4)
    for n, row in enumerate(rows):
        row["type"] = "test.kept" if n % 3 else "test.other"
    since = datetime.now(UTC) - timedelta(seconds=5)
    _published(engine, kafka_bootstrap, rows, relay_mode)
    first = read_committed(kafka_bootstrap, [topic])
    url = ("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap)

    dry = _cli("--from-outbox", "--since", since.isoformat(), "--type", "test.kept", *url)
    assert dry.exit_code == 0, dry.output
    assert f"dry run: 40 row(s) would be republished ({topic}: 40)" in dry.stdout
    assert len(read_committed(kafka_bootstrap, [topic])) == 60, "a dry run sends nothing"

    done = _cli(
        *("--from-outbox", "--since", since.isoformat(), "--type", "test.kept", "--execute"),
        *url,
    )
    assert done.exit_code == 0, done.output
    assert f"republished 40 row(s) with their original event ids ({topic}: 40)" in done.stdout

    records = read_committed(kafka_bootstrap, [topic])
    copies = [r for r in records if (r.topic, r.partition, r.offset) not in _positions(first)]
    kept = [row for row in rows if row["type"] == "test.kept"]
    assert sorted(_ids(copies)) == sorted(str(row["id"]) for row in kept)
    originals = {r.headers["id"]: r for r in first}
    for copy in copies:  # the same record: key, value, headers (id, eventType, extras), time
        original = originals[copy.headers["id"]]
        assert (copy.key, copy.value, copy.headers, copy.partition) == (
            original.key,
            original.value,
            original.headers,
            original.partition,
        )
    for key in {str(row["aggregateid"]) for row in kept}:
        in_order = [str(row["id"]) for row in kept if row["aggregateid"] == key]
        on_topic = _ids(sorted((c for c in copies if c.key == key), key=lambda r: r.offset))
        assert on_topic == in_order, f"copies of {key} in seq order"


def _positions(records: list[Record]) -> set[tuple[str, int, int]]:
    return {(r.topic, r.partition, r.offset) for r in records}


def test_a_window_with_purged_rows_is_refused(
    engine: sa.Engine, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    since = datetime.now(UTC) - timedelta(seconds=5)
    rows = outbox_rows(10, topics=[topic], keys=2)
    for n, row in enumerate(rows):
        row["created_at"] = datetime.now(UTC) - timedelta(days=8 if n < 4 else 0)
    _published(engine, kafka_bootstrap, rows)
    assert plan_republish(engine, since=since, until=None, event_type=None).rows == 6
    assert RelayStore(engine, owner="t").purge(older_than_seconds=7 * 86400) == 4

    for start in (since - timedelta(days=9), since):  # both begin before the oldest row left
        with pytest.raises(RepublishError, match="rows of the window were purged: the oldest"):
            plan_republish(engine, since=start, until=None, event_type=None)
    oldest_left = rows[4]["created_at"]
    assert isinstance(oldest_left, datetime)
    assert plan_republish(engine, since=oldest_left, until=None, event_type=None).rows == 6


def test_a_window_with_a_parked_key_or_unpublished_rows_is_refused(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    since = datetime.now(UTC) - timedelta(seconds=5)
    rows = outbox_rows(6, topics=[topic], keys=2)
    _published(engine, kafka_bootstrap, rows)
    with engine.begin() as conn:  # as the relay parks a key whose row failed for good
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason) "
                "VALUES (:t, 'key-1', :s, :e, 'dead')"
            ),
            {"t": topic, "s": shard_of(topic, "key-1", 32), "e": rows[1]["id"]},
        )
    with pytest.raises(RepublishError, match=r"3 row\(s\) of the window belong to parked keys"):
        plan_republish(engine, since=since, until=None, event_type=None)
    result = _cli(
        *("--from-outbox", "--since", since.isoformat(), "--execute"),
        *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
    )
    assert result.exit_code == 1
    assert "key 'key-1' (dead row" in result.stderr
    assert "requeue or skip it first" in result.stderr
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM oncely_relay_parked"))

    insert_rows(engine, outbox_rows(2, topics=[topic], keys=2))  # no relay runs now
    with pytest.raises(RepublishError, match=r"2 row\(s\) of the window are not published yet"):
        plan_republish(engine, since=since, until=None, event_type=None)
    until = datetime.now(UTC) + timedelta(hours=1)
    with pytest.raises(RepublishError, match="--since must be earlier than --until"):
        plan_republish(engine, since=until, until=until, event_type=None)
    assert len(read_topics(kafka_bootstrap, [topic])) == 6, "nothing was sent"


def test_on_partitioned_tables_a_window_before_the_dropped_partitions_is_refused(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    step = timedelta(minutes=1)
    upgrade(engine, partition_every=step)
    topic = new_topic()
    now: datetime = scalar(engine, "SELECT now()")
    minutes = [
        partitions.window_start(now - timedelta(minutes=10), step) + step * n for n in range(5)
    ]
    with engine.begin() as conn:
        for start in minutes:
            partitions.create_partition(conn, "oncely_outbox", start, start + step)
    # A row in the default partition (an id no range holds: a client clock behind) created
    # before the window, then two rows in each of the minutes M1..M5.
    stray = outbox_rows(1, topics=[topic], keys=1)[0]
    stray.update(
        id=uuid7_at(now - timedelta(minutes=30)), created_at=minutes[0] - timedelta(minutes=5)
    )
    rows = outbox_rows(10, topics=[topic], keys=2)
    for n, row in enumerate(rows):
        moment = minutes[n // 2] + timedelta(seconds=10 + n % 2)
        row.update(id=uuid7_at(moment), created_at=moment)
    _published(engine, kafka_bootstrap, [stray, *rows])
    with engine.connect() as conn:
        oldest = partitions.partitions(conn, "oncely_outbox")[:3]
    for partition in oldest:  # as retention drops M1..M3, oldest first
        assert partition.lower in minutes[:3], partition
        with engine.begin() as conn:
            partitions.freeze(conn, partition, timeout=5)
            partitions.drop(conn, partition, timeout=5)
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox_default") == 1
    url = ("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap)

    refused = _cli("--from-outbox", "--since", minutes[0].isoformat(), "--execute", *url)
    assert refused.exit_code == 1, refused.output
    assert "rows of the window were purged" in refused.stderr
    assert minutes[3].isoformat() in refused.stderr  # where the retained partitions start
    assert len(read_topics(kafka_bootstrap, [topic])) == 11, "nothing was sent"
    for start in (minutes[0], minutes[2] + timedelta(seconds=30)):  # before M4's partition
        with pytest.raises(RepublishError, match="rows of the window were purged"):
            plan_republish(engine, since=start, until=None, event_type=None)

    # A window inside the retained partitions is republished whole.
    assert plan_republish(engine, since=minutes[3], until=None, event_type=None).rows == 4
    done = _cli("--from-outbox", "--since", minutes[3].isoformat(), "--execute", *url)
    assert done.exit_code == 0, done.output
    assert f"republished 4 row(s) with their original event ids ({topic}: 4)" in done.stdout
    copies = _ids(read_topics(kafka_bootstrap, [topic]))[11:]
    assert sorted(copies) == sorted(str(row["id"]) for row in rows[6:])
