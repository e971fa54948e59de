"""`oncely dead list|requeue|skip` and `oncely relay purge` as processes.

A dead row parks its key (later rows of it are held); requeue and skip record a request that a
running relay carries out. Without --execute (or --yes, for ids named) they are dry runs: they
print what they would change, and change nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import sqlalchemy as sa

from oncely.storage import outbox
from tests.helpers import (
    Record,
    acknowledge_all,
    count_published,
    insert_rows,
    oncely_process,
    outbox_rows,
    park,
    read_topics,
    scalar,
    set_topic_config,
    start_oncely,
    wait_until,
)

pytestmark = pytest.mark.acceptance

#: The error of a row that failed for good, as the relay records it.
TOO_BIG = "MSG_SIZE_TOO_LARGE: too big"


def _requests(engine: sa.Engine) -> dict[str, str | None]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT event_id, request FROM oncely_relay_parked")).all()
    return {str(r.event_id): r.request for r in rows}


def _dead_rows(engine: sa.Engine) -> list[dict[str, object]]:
    """Three dead rows (topic a: one, topic b: two), the first with two rows held behind it."""
    rows = outbox_rows(5, topics=["a"], keys=5)
    for row, topic in zip(rows, ["a", "b", "b", "a", "a"], strict=True):
        row["topic"] = topic
    rows[3]["aggregateid"] = rows[4]["aggregateid"] = rows[0]["aggregateid"]
    insert_rows(engine, rows)
    acknowledge_all(engine)
    park(engine, rows[0], held=rows[3:], error=TOO_BIG)
    park(engine, rows[1], error=TOO_BIG)
    park(engine, rows[2], error=TOO_BIG)
    return rows[:3]


def test_dead_rows_are_listed_with_held_rows_error_and_request(
    engine: sa.Engine, database_url: str
) -> None:
    rows = _dead_rows(engine)
    url = ("--database-url", database_url)
    listed = oncely_process("dead", "list", *url)
    assert listed.returncode == 0, listed.stderr
    assert "3 dead row(s)" in listed.stdout
    assert "MSG_SIZE_TOO_LARGE" in listed.stdout
    first = next(line for line in listed.stdout.splitlines() if str(rows[0]["id"]) in line)
    assert "topic=a  key=key-0  type=test.event  held=2  request=-" in first

    refused = oncely_process("dead", "requeue", *url)
    assert refused.returncode == 2
    assert "name row ids, --topic T or --all" in refused.stderr
    skipped = oncely_process("dead", "skip", *url, str(rows[0]["id"]), "--yes")
    assert skipped.returncode == 0, skipped.stderr
    assert "skip requested for 1 row(s): a running relay (`oncely relay run`)" in skipped.stdout
    assert str(rows[0]["id"]) in skipped.stdout
    requeued = oncely_process("dead", "requeue", *url, "--topic", "b", "--execute")
    assert "requeue requested for 2 row(s): a running relay" in requeued.stdout
    assert _requests(engine) == {
        str(rows[0]["id"]): "skip",
        str(rows[1]["id"]): "requeue",
        str(rows[2]["id"]): "requeue",
    }
    after = oncely_process("dead", "list", *url, "--topic", "b")
    assert "2 dead row(s)" in after.stdout
    assert after.stdout.count("request=requeue") == 2


def test_dead_requeue_and_skip_are_dry_runs_without_execute(
    engine: sa.Engine, database_url: str
) -> None:
    rows = _dead_rows(engine)
    url = ("--database-url", database_url)
    every = oncely_process("dead", "requeue", *url, "--all")
    assert every.returncode == 0, every.stderr
    assert "would requeue 3 row(s)" in every.stdout
    assert all(str(row["id"]) in every.stdout for row in rows)
    assert f"{rows[0]['id']}  a  key=key-0  test.event  held=2" in every.stdout
    assert "dry run: nothing changed; run again with --execute" in every.stdout
    of_topic = oncely_process("dead", "requeue", *url, "--topic", "b")
    assert "would requeue 2 row(s)" in of_topic.stdout
    unknown = uuid.uuid4()
    named = oncely_process("dead", "requeue", *url, str(rows[0]["id"]), str(unknown))
    assert "would requeue 1 row(s)" in named.stdout
    assert f"{unknown}  not a dead or delayed row: unchanged" in named.stdout
    assert "run again with --yes" in named.stdout
    skip = oncely_process("dead", "skip", *url, str(rows[1]["id"]))
    assert skip.returncode == 0, skip.stderr
    assert "would skip 1 row(s)" in skip.stdout
    assert str(rows[1]["id"]) in skip.stdout
    assert set(_requests(engine).values()) == {None}
    # --yes confirms ids named only; a whole topic or every row needs --execute.
    vague = oncely_process("dead", "requeue", *url, "--all", "--yes")
    assert vague.returncode == 2
    assert "use --execute with --topic or --all" in vague.stderr
    assert set(_requests(engine).values()) == {None}
    done = oncely_process("dead", "requeue", *url, "--all", "--execute")
    assert "requeue requested for 3 row(s)" in done.stdout
    assert set(_requests(engine).values()) == {"requeue"}


def _start_relay(database_url: str, bootstrap: str, log: Path) -> subprocess.Popen[str]:
    with log.open("wb") as stderr:
        return start_oncely(
            "relay",
            "run",
            env={
                "ONCELY_DATABASE_URL": database_url,
                "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                "ONCELY_RELAY_MAX_ATTEMPTS": "1",
                "ONCELY_RELAY_BACKOFF_BASE_SECONDS": "0.1",
                "ONCELY_RELAY_BACKOFF_MAX_SECONDS": "0.5",
                "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2",
            },
            stderr=stderr,
        )


def ids(records: Iterable[Record]) -> list[str]:
    return [r.headers["id"].decode() for r in records]


def _parked(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM oncely_relay_parked"))


def test_a_running_relay_requeues_in_order_and_skip_releases_the_key(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(partitions=1, config={"max.message.bytes": "10000"})
    rows = outbox_rows(12, topics=[topic], keys=3)  # key-i: rows i, i+3, i+6, i+9
    rows[3]["payload"] = os.urandom(50_000)  # key-0's second: the broker refuses it
    rows[4]["payload"] = os.urandom(50_000)  # key-1's second
    insert_rows(engine, rows)
    relay = _start_relay(database_url, kafka_bootstrap, tmp_path / "relay.log")
    try:
        wait_until(lambda: _parked(engine) == 2 and count_published(engine) == 6, timeout=60)
        url = ("--database-url", database_url)
        listed = oncely_process("dead", "list", *url)
        assert "2 dead row(s)" in listed.stdout, listed.stdout
        assert "MSG_SIZE_TOO_LARGE" in listed.stdout
        before = read_topics(kafka_bootstrap, [topic])
        assert set(ids(before)) == {str(rows[i]["id"]) for i in (0, 1, 2, 5, 8, 11)}, (
            "the later rows of both parked keys are held"
        )

        set_topic_config(kafka_bootstrap, topic, "max.message.bytes", "200000")
        requeue = oncely_process("dead", "requeue", *url, str(rows[3]["id"]), "--yes")
        assert "requeue requested for 1 row(s): a running relay" in requeue.stdout
        skip = oncely_process("dead", "skip", *url, str(rows[4]["id"]), "--yes")
        assert "skip requested for 1 row(s): a running relay" in skip.stdout
        wait_until(lambda: _parked(engine) == 0, timeout=60)
        assert "0 dead row(s)" in oncely_process("dead", "list", *url).stdout
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(60) == 0, (tmp_path / "relay.log").read_text()
    records = read_topics(kafka_bootstrap, [topic])

    def first_copies(key: str) -> list[str]:
        return list(dict.fromkeys(ids(r for r in records if r.key == key)))

    expected = {
        key: [str(r["id"]) for r in rows if r["aggregateid"] == key]
        for key in ("key-0", "key-1", "key-2")
    }
    assert first_copies("key-0") == expected["key-0"], "requeued: the dead row, then the held"
    assert first_copies("key-1") == [e for e in expected["key-1"] if e != str(rows[4]["id"])], (
        "skipped: the held rows without the dead one"
    )
    assert first_copies("key-2") == expected["key-2"]


def test_relay_purge_deletes_old_acknowledged_rows_but_not_parked_keys(
    engine: sa.Engine, database_url: str
) -> None:
    rows = outbox_rows(5, topics=["a"], keys=5)
    for n, row in enumerate(rows):
        row["created_at"] = sa.text(f"now() - interval '{8 if n % 2 == 0 else 1} days'")
    with engine.begin() as conn:
        for row in rows:
            conn.execute(sa.insert(outbox).values(**row))
    acknowledge_all(engine)
    park(engine, rows[4], error=TOO_BIG)  # 8 days old, but its key is parked: kept
    result = oncely_process(
        "relay", "purge", "--database-url", database_url, "--older-than", "7d", "--execute"
    )
    assert result.returncode == 0, result.stderr
    assert "deleted 2 published row(s) older than 7d" in result.stdout
    with engine.connect() as conn:
        left = set(conn.execute(sa.text("SELECT id FROM oncely_outbox")).scalars())
    assert left == {rows[n]["id"] for n in (1, 3, 4)}
    bad = oncely_process("relay", "purge", "--database-url", database_url, "--older-than", "a week")
    assert bad.returncode == 2
    assert "not a duration" in bad.stderr


def test_relay_purge_is_a_dry_run_without_execute(engine: sa.Engine, database_url: str) -> None:
    rows = outbox_rows(3, topics=["a", "b"], keys=1)
    for row in rows:
        row["created_at"] = sa.text("now() - interval '8 days'")
    with engine.begin() as conn:
        for row in rows:
            conn.execute(sa.insert(outbox).values(**row))
    unpublished = outbox_rows(1, topics=["a"], keys=1)
    unpublished[0]["created_at"] = sa.text("now() - interval '9 days'")
    acknowledge_all(engine)
    with engine.begin() as conn:  # committed after the progress: not purged
        conn.execute(sa.insert(outbox).values(**unpublished[0]))
    result = oncely_process("relay", "purge", "--database-url", database_url, "--older-than", "7d")
    assert result.returncode == 0, result.stderr
    assert "would delete 3 published row(s) older than 7d" in result.stdout
    assert f"  a: 2 row(s), oldest {rows[0]['id']} created " in result.stdout
    assert f"  b: 1 row(s), oldest {rows[1]['id']} created " in result.stdout
    assert "dry run: nothing changed; run again with --execute" in result.stdout
    assert count_published(engine) == 3
