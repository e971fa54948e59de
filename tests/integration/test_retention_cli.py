"""``oncely db upgrade --partition-every`` and ``oncely retention plan|run`` against real
PostgreSQL and Kafka: the conversion, the plan's verdicts as JSON, a run dropping what the guard
lets go, and the one-line errors (not partitioned, a bad step, Kafka unreachable, a partition
not created)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa

from oncely.storage import partitions
from tests.helpers import (
    CliResult,
    acknowledge_all,
    execute,
    insert_rows,
    oncely_cli,
    outbox_row,
    scalar,
    uuid7_at,
)

pytestmark = pytest.mark.integration

STEP = timedelta(minutes=1)
HORIZONS = ("--outbox-horizon", "1m", "--receipts-horizon", "1m")


def _cli(database_url: str, bootstrap: str, *argv: str) -> CliResult:
    return oncely_cli(
        *argv,
        env={"ONCELY_DATABASE_URL": database_url, "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap},
    )


def _one_line_error(result: CliResult, code: int, text: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert text in lines[0]


@pytest.fixture
def partitioned(database_url: str, kafka_bootstrap: str, engine: sa.Engine) -> datetime:
    """Converted to 1-minute partitions by the command, with the last 20 minutes' created;
    returns the database's clock."""
    result = _cli(database_url, kafka_bootstrap, "db", "upgrade", "--partition-every", "1m")
    assert result.exit_code == 0, result.output
    assert "converted oncely_outbox" in result.stdout
    assert "converted oncely_receipts" in result.stdout
    now: datetime = scalar(engine, "SELECT now()")
    start = partitions.window_start(now, STEP)
    with engine.begin() as conn:
        for table in partitions.PARTITION_KEYS:
            for n in range(1, 21):
                partitions.create_partition(conn, table, start - STEP * n, start - STEP * (n - 1))
    return now


def _name(moment: datetime) -> str:
    return partitions.partition_name("oncely_outbox", partitions.window_start(moment, STEP))


def _exists(engine: sa.Engine, name: str) -> bool:
    return scalar(engine, "SELECT to_regclass(:n) IS NOT NULL", n=name) is True


def test_db_upgrade_partition_every_converts_once_and_refuses_a_bad_or_other_step(
    database_url: str, kafka_bootstrap: str, engine: sa.Engine
) -> None:
    bad = _cli(database_url, kafka_bootstrap, "db", "upgrade", "--partition-every", "7m")
    _one_line_error(bad, 2, "partition step '7m'")
    with engine.connect() as conn:
        assert partitions.step_of(conn) is None
    done = _cli(database_url, kafka_bootstrap, "db", "upgrade", "--partition-every", "1m")
    assert done.exit_code == 0, done.output
    assert "converted oncely_outbox: " in done.stdout
    with engine.connect() as conn:
        assert partitions.step_of(conn) == STEP
    again = _cli(database_url, kafka_bootstrap, "db", "upgrade", "--partition-every", "1m")
    assert again.exit_code == 0, again.output
    assert "already partitioned by 1m" in again.stdout
    other = _cli(database_url, kafka_bootstrap, "db", "upgrade", "--partition-every", "2m")
    _one_line_error(other, 2, "the step cannot change")


def test_retention_refuses_unpartitioned_tables_in_one_line(
    database_url: str, kafka_bootstrap: str
) -> None:
    for command in (("plan",), ("run", "--execute")):
        result = _cli(database_url, kafka_bootstrap, "retention", *command)
        _one_line_error(result, 2, "the outbox and the receipts are not partitioned")


def test_retention_says_in_one_line_that_kafka_does_not_answer(
    database_url: str, partitioned: datetime
) -> None:
    result = _cli(database_url, "127.0.0.1:1", "retention", "plan")
    _one_line_error(result, 1, "no Kafka broker answered at 127.0.0.1:1")


def test_plan_lists_verdicts_and_run_executes_only_with_execute(
    database_url: str, kafka_bootstrap: str, engine: sa.Engine, partitioned: datetime
) -> None:
    published, unpublished = (partitioned - timedelta(minutes=m) for m in (12, 6))
    insert_rows(engine, [outbox_row("t", "a", event_id=uuid7_at(published))])
    acknowledge_all(engine)
    insert_rows(engine, [outbox_row("t", "b", event_id=uuid7_at(unpublished))])

    result = _cli(database_url, kafka_bootstrap, "retention", "plan", "--json", *HORIZONS)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["executed"] is False and plan["step_seconds"] == 60
    verdicts = {v["partition"]: v for v in plan["verdicts"]}
    assert set(verdicts[_name(published)]) == {
        "table",
        "partition",
        "lower",
        "upper",
        "bytes",
        "droppable",
        "reason",
    }
    assert verdicts[_name(published)]["droppable"] is True
    assert verdicts[_name(published)]["reason"] is None
    assert "has not passed all its rows" in verdicts[_name(unpublished)]["reason"]
    assert {t["table"] for t in plan["tables"]} == {"oncely_outbox", "oncely_receipts"}
    assert all("blocked_seconds" in t and "default_rows" in t for t in plan["tables"])

    human = _cli(database_url, kafka_bootstrap, "retention", "plan", *HORIZONS)
    assert human.exit_code == 0, human.output
    assert _name(published) in human.stdout and "droppable" in human.stdout
    assert "has not passed all its rows" in human.stdout

    dry = _cli(database_url, kafka_bootstrap, "retention", "run", *HORIZONS)
    assert dry.exit_code == 0, dry.output
    assert "dry run: nothing changed" in dry.stdout
    assert _exists(engine, _name(published))

    done = _cli(database_url, kafka_bootstrap, "retention", "run", "--execute", "--json", *HORIZONS)
    assert done.exit_code == 0, done.output  # partitions kept: normal
    outcome = json.loads(done.stdout)
    assert outcome["executed"] is True and outcome["errors"] == []
    assert _name(published) in outcome["dropped"]
    assert _name(unpublished) not in outcome["dropped"]
    assert any(v["partition"] == _name(unpublished) for v in outcome["kept"])
    assert not _exists(engine, _name(published))
    assert _exists(engine, _name(unpublished))
    counts = {
        when: {t["table"]: t["partitions"] for t in document["tables"]}
        for when, document in (("before", plan), ("after", outcome))
    }
    gone = sum(1 for name in outcome["dropped"] if name.startswith("oncely_outbox_"))
    new = sum(1 for name in outcome["created"] if name.startswith("oncely_outbox_"))
    assert counts["after"]["oncely_outbox"] == counts["before"]["oncely_outbox"] - gone + new
    assert scalar(engine, "SELECT count(*) FROM oncely_outbox") == 1


def test_run_exits_nonzero_when_a_partition_cannot_be_created_ahead(
    database_url: str, kafka_bootstrap: str, engine: sa.Engine, partitioned: datetime
) -> None:
    # A type holds the name of the partition 10 minutes ahead (its row type cannot be made).
    blocked = _name(partitioned + timedelta(minutes=10))
    execute(engine, f"CREATE TYPE {blocked} AS ENUM ('x')")
    result = oncely_cli(
        "retention",
        "run",
        "--execute",
        *HORIZONS,
        env={
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "ONCELY_RETENTION_AHEAD": "12",
        },
    )
    assert result.exit_code == 1, result.output
    assert f"{blocked}: not created (DuplicateObject" in result.stdout
    # The others were created.
    assert _exists(engine, _name(partitioned + timedelta(minutes=11)))


def test_run_refuses_partitions_ahead_that_do_not_outlast_its_interval(
    database_url: str, kafka_bootstrap: str, engine: sa.Engine, partitioned: datetime
) -> None:
    env = {
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "ONCELY_RETENTION_AHEAD": "3",
    }
    refused = oncely_cli("retention", "run", "--execute", "--interval", "10m", env=env)
    _one_line_error(refused, 2, "set ONCELY_RETENTION_AHEAD to 11 or more")
    assert not _exists(engine, _name(partitioned + timedelta(minutes=4)))
    by_setting = oncely_cli(
        "retention", "run", "--execute", env={**env, "ONCELY_RETENTION_RUN_INTERVAL_SECONDS": "600"}
    )
    _one_line_error(by_setting, 2, "cover 3 min, not the 10 min between retention runs")
    done = oncely_cli(
        "retention",
        "run",
        "--execute",
        "--interval",
        "10m",
        *HORIZONS,
        env={**env, "ONCELY_RETENTION_AHEAD": "11"},
    )
    assert done.exit_code == 0, done.output
    assert _exists(engine, _name(partitioned + timedelta(minutes=10)))
