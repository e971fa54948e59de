"""`oncely dead list|requeue|skip` and `oncely relay purge` print what they changed.

Without --execute (or --yes, for ids named) they are dry runs: they print what they would
change, and change nothing.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.helpers import count_published, insert_rows, outbox_rows

pytestmark = pytest.mark.acceptance


def _oncely(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oncely", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


def test_dead_rows_are_listed_requeued_and_skipped(engine: sa.Engine, database_url: str) -> None:
    rows = outbox_rows(3, topics=["a"], keys=3)
    for row, topic in zip(rows, ["a", "b", "b"], strict=True):
        row["topic"] = topic
        row["status"] = "dead"
        row["attempts"] = 5
        row["last_error"] = "MSG_SIZE_TOO_LARGE: too big"
    insert_rows(engine, rows)
    listed = _oncely("dead", "list", "--database-url", database_url)
    assert listed.returncode == 0, listed.stderr
    assert "3 dead row(s)" in listed.stdout
    assert "too big" in listed.stdout

    refused = _oncely("dead", "requeue", "--database-url", database_url)
    assert refused.returncode == 2
    skipped = _oncely("dead", "skip", "--database-url", database_url, str(rows[0]["id"]), "--yes")
    assert "skipped 1 row(s)" in skipped.stdout
    assert str(rows[0]["id"]) in skipped.stdout
    requeued = _oncely(
        "dead", "requeue", "--database-url", database_url, "--topic", "b", "--execute"
    )
    assert "requeued 2 row(s)" in requeued.stdout
    with engine.connect() as conn:
        attempts = conn.execute(
            sa.text("SELECT attempts FROM oncely_outbox WHERE status = 'pending'")
        ).scalars()
        assert list(attempts) == [0, 0]
    assert count_status(engine, "skipped") == 1


def test_relay_purge_deletes_old_published_rows(engine: sa.Engine, database_url: str) -> None:
    rows = outbox_rows(4, topics=["a"], keys=4)
    insert_rows(engine, rows)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE oncely_outbox SET status = 'published', published_at = now() - "
                "CASE WHEN seq % 2 = 0 THEN interval '8 days' ELSE interval '1 day' END"
            )
        )
    result = _oncely(
        "relay", "purge", "--database-url", database_url, "--older-than", "7d", "--execute"
    )
    assert result.returncode == 0, result.stderr
    assert "deleted 2 published row(s) older than 7d" in result.stdout
    assert count_published(engine) == 2
    bad = _oncely("relay", "purge", "--database-url", database_url, "--older-than", "a week")
    assert bad.returncode == 2
    assert "not a duration" in bad.stderr


def _dead_rows(engine: sa.Engine) -> list[dict[str, object]]:
    rows = outbox_rows(3, topics=["a"], keys=3)
    for row, topic in zip(rows, ["a", "b", "b"], strict=True):
        row["topic"] = topic
        row["status"] = "dead"
        row["attempts"] = 5
    insert_rows(engine, rows)
    return rows


def test_dead_requeue_and_skip_are_dry_runs_without_execute(
    engine: sa.Engine, database_url: str
) -> None:
    rows = _dead_rows(engine)
    url = ("--database-url", database_url)
    every = _oncely("dead", "requeue", *url, "--all")
    assert every.returncode == 0, every.stderr
    assert "would requeue 3 row(s)" in every.stdout
    assert all(str(row["id"]) in every.stdout for row in rows)
    assert "dry run: nothing changed; run again with --execute" in every.stdout
    of_topic = _oncely("dead", "requeue", *url, "--topic", "b")
    assert "would requeue 2 row(s)" in of_topic.stdout
    unknown = uuid.uuid4()
    named = _oncely("dead", "requeue", *url, str(rows[0]["id"]), str(unknown))
    assert "would requeue 1 row(s)" in named.stdout
    assert f"{unknown}  not a dead row: unchanged" in named.stdout
    assert "run again with --yes" in named.stdout
    skip = _oncely("dead", "skip", *url, str(rows[1]["id"]))
    assert skip.returncode == 0, skip.stderr
    assert "would skip 1 row(s)" in skip.stdout
    assert str(rows[1]["id"]) in skip.stdout
    assert count_status(engine, "dead") == 3
    # --yes confirms ids named only; a whole topic or every row needs --execute.
    vague = _oncely("dead", "requeue", *url, "--all", "--yes")
    assert vague.returncode == 2
    assert "use --execute with --topic or --all" in vague.stderr
    assert count_status(engine, "dead") == 3
    done = _oncely("dead", "requeue", *url, str(rows[0]["id"]), "--yes")
    assert "requeued 1 row(s)" in done.stdout
    done = _oncely("dead", "skip", *url, str(rows[1]["id"]), "--execute")
    assert "skipped 1 row(s)" in done.stdout
    done = _oncely("dead", "requeue", *url, "--all", "--execute")
    assert "requeued 1 row(s)" in done.stdout
    assert (count_status(engine, "pending"), count_status(engine, "skipped")) == (2, 1)


def test_relay_purge_is_a_dry_run_without_execute(engine: sa.Engine, database_url: str) -> None:
    rows = outbox_rows(3, topics=["a", "b"], keys=1)
    insert_rows(engine, rows)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE oncely_outbox SET status = 'published', "
                "published_at = now() - interval '8 days'"
            )
        )
    result = _oncely("relay", "purge", "--database-url", database_url, "--older-than", "7d")
    assert result.returncode == 0, result.stderr
    assert "would delete 3 published row(s) older than 7d" in result.stdout
    assert "  a: 2 row(s), oldest " in result.stdout
    assert f"  b: 1 row(s), oldest {rows[1]['id']} published " in result.stdout
    assert "dry run: nothing changed; run again with --execute" in result.stdout
    assert count_published(engine) == 3
