"""``oncely status`` against a small known deployment: exact numbers, read from real services."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy.engine import make_url

from oncely.cli.status import status as status_command
from oncely.devstack._process import free_port
from oncely.ops.status import DUPLICATES_NOTE, KAFKA_SECONDS, collect_status
from oncely.schemas.codec import Codec
from oncely.storage import outbox, receipts, tasks
from oncely.storage.stores.outbox.relay import RelayStore
from oncely.storage.tables import shard_of
from tests.apps.ledger import App, build
from tests.helpers import (
    CliResult,
    acknowledge_all,
    effect_status,
    oncely_cli,
    outbox_row,
    park,
    publish_events,
    running_consumers,
    scalar,
    start_oncely,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]


@pytest.fixture
def app(kafka_admin: AdminClient) -> Iterator[App]:
    """Not the shared ``app``: without the ``ways`` variants, and the notify effect's
    dead-letter topic created too."""
    prefix = f"t{uuid.uuid4().hex[:10]}."
    app = build(prefix, group_prefix=prefix)
    created = [app.topic, f"{app.topic}.notify.dlq"]
    futures = kafka_admin.create_topics(
        [NewTopic(app.topic, num_partitions=2), NewTopic(created[1], num_partitions=1)]
    )
    for future in futures.values():
        future.result(30)
    yield app
    for future in kafka_admin.delete_topics(created).values():
        future.result(30)


def _cli(*args: str) -> CliResult:
    return oncely_cli("status", *args)


def _task(status: str) -> dict[str, Any]:
    return {
        "id": uuid.uuid4(),
        "task_key": uuid.uuid4().hex,
        "name": "email.send",
        "payload": {},
        "policy": "retry_safe",
        "max_attempts": 3,
        "status": status,
    }


SHARDS = 32
LEASED = range(16)  # relay-a holds shards 0-15; 16-31 are free


@pytest.fixture
def deployment(app: App, engine: sa.Engine, kafka_bootstrap: str) -> str:
    """The known setup; returns the other topic that has outbox rows but no event type.

    Acknowledged (the progress passed them): 3 rows, a dead row of acc-0 with 2 rows held
    behind it (asked to be requeued), a delayed row of acc-9 of the other topic with 1 held.
    Unpublished: 2 rows of the app's topic created 120 s ago (acc-1, acc-2), 1 of the other.
    """
    other = f"{app.topic}.other"
    ago = sa.text("now() - interval '120 seconds'")
    dead, delayed = outbox_row(app.topic), outbox_row(other, "acc-9")
    held = [outbox_row(app.topic), outbox_row(app.topic), outbox_row(other, "acc-9")]
    passed = [*(outbox_row(app.topic, f"acc-{n}") for n in range(3)), dead, delayed, *held]
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox), passed)
    with engine.begin() as conn:  # what a relay records once every row above is acknowledged
        acknowledge_all(conn)
        conn.execute(
            sa.text(
                "UPDATE oncely_relay_shards SET owner = 'relay-a', epoch = epoch + 2, "
                "lease_until = now() + interval '1 hour' WHERE shard < 16"
            )
        )
        park(conn, dead, held=held[:2], error="MSG_SIZE_TOO_LARGE", request="requeue")
        park(conn, delayed, "delayed", held=held[2:], until_seconds=3600)
    unpublished = [
        outbox_row(app.topic, "acc-1", created_at=ago),
        outbox_row(app.topic, "acc-2", created_at=ago),
        outbox_row(other, "acc-5"),
    ]
    with engine.begin() as conn:
        for row in unpublished:
            conn.execute(sa.insert(outbox).values(**row))
    receipt_rows = [
        {
            "event_id": uuid.uuid4(),
            "effect": "ledger",
            "applied_at": sa.text("now() - interval '10 minutes'"),
        },
        {"event_id": uuid.uuid4(), "effect": "retired"},
    ]
    with engine.begin() as conn:
        for receipt in receipt_rows:
            conn.execute(sa.insert(receipts).values(**receipt))
        conn.execute(sa.insert(tasks), [_task("queued"), _task("queued"), _task("dead")])
    events = [(uuid.uuid4(), app.model(account_id=f"acc-{i}", amount=1, n=i)) for i in range(5)]
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    dlq = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(2):
        dlq.produce(f"{app.topic}.notify.dlq", key=b"acc-0", value=str(n).encode())
    assert dlq.flush(30) == 0
    with running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap):
        wait_until(
            lambda: (
                scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = 'ledger'") == 6
            ),
            timeout=60,
        )
    return other


def _unpublished_keys(app: App, other: str) -> list[tuple[str, str]]:
    return [(app.topic, "acc-1"), (app.topic, "acc-2"), (other, "acc-5")]


def _effect(app: App, name: str, **values: Any) -> dict[str, Any]:
    """The effect's entry: five records behind unless ``values`` say otherwise."""
    return effect_status(app, name, **{"lag": 5, **values})


def test_status_reports_backlog_progress_and_tasks_of_a_known_setup(
    app: App, engine: sa.Engine, kafka_bootstrap: str, deployment: str
) -> None:
    report = collect_status(
        engine, effects=app.effects, kafka_config={"bootstrap.servers": kafka_bootstrap}
    ).to_json()
    idle = sorted(
        {shard_of(t, k, SHARDS) for t, k in _unpublished_keys(app, deployment)} - set(LEASED)
    )
    idle_note = (
        [
            f"{len(idle)} shard(s) with unpublished rows are held by no relay "
            f"({', '.join(map(str, idle))}): is `oncely relay run` running?"
        ]
        if idle
        else []
    )

    topics = report["topics"]
    assert [t["oldest_unpublished_seconds"] for t in topics] == [
        pytest.approx(120, abs=30),
        pytest.approx(0, abs=30),
    ]
    # The topic prefix is random: two of these keys may share a shard (then its row count is 2).
    backlog = Counter(
        (topic, shard_of(topic, key, SHARDS))
        for topic, key in ((app.topic, "acc-1"), (app.topic, "acc-2"), (deployment, "acc-5"))
    )
    assert [(b["topic"], b["shard"], b["unpublished"]) for b in report["backlog"]] == [
        (topic, shard, rows)
        for (topic, shard), rows in sorted(
            backlog.items(), key=lambda item: (item[0][1], item[0][0])
        )
    ]
    by_shard = {s["shard"]: s for s in report.pop("shards")}
    assert sorted(by_shard) == list(range(SHARDS))
    for shard, state in by_shard.items():
        assert (state["owner"], state["leased"]) == (
            ("relay-a", True) if shard in LEASED else (None, False)
        )
        assert state["epoch"] == (2 if shard in LEASED else 0)
        assert state["unpublished"] == sum(n for (_, s), n in backlog.items() if s == shard)
    report.pop("backlog")
    completeness = report.pop("completeness")  # every row is within the grace period
    assert [(c["effect"], c["missing"]) for c in completeness] == [
        (name, 0) for name in app.effects.names()
    ]
    assert report == {
        "database": engine.url.render_as_string(hide_password=True),
        "topics": [
            {
                "topic": app.topic,
                "unpublished": 2,
                "oldest_unpublished_seconds": topics[0]["oldest_unpublished_seconds"],
                "dead": 1,
                "delayed": 0,
                "held_keys": 1,
                "held_rows": 2,
                "requested": 1,
                "blocked_rows": 0,
                "blocked_since": None,
                "blocked_error": None,
            },
            {
                "topic": deployment,
                "unpublished": 1,
                "oldest_unpublished_seconds": topics[1]["oldest_unpublished_seconds"],
                "dead": 0,
                "delayed": 1,
                "held_keys": 1,
                "held_rows": 1,
                "requested": 0,
                "blocked_rows": 0,
                "blocked_since": None,
                "blocked_error": None,
            },
        ],
        "effects": [
            _effect(app, "audit"),
            _effect(app, "email"),
            _effect(app, "ledger", applied=6, applied_last_minute=5, lag=0),
            _effect(app, "notify", dlq=2),
            {
                "effect": "retired",
                "group": None,
                "topics": [],
                "applied": 1,
                "applied_last_minute": 1,
                "lag": None,
                "dlq": None,
                "duplicates_suppressed": None,
            },
            _effect(app, "strict"),
        ],
        "tasks": {
            "queued": 2,
            "leased": 0,
            "completed": 0,
            "dead": 1,
            "failed": 0,
            "stale": 0,
            "expired": 0,
        },
        "notes": [
            DUPLICATES_NOTE,
            *idle_note,
            "effect 'retired' has receipts but is not in the app",
        ],
        "kafka_error": None,
    }


def test_without_app_or_kafka_effects_come_from_receipts_and_lag_is_unknown(
    engine: sa.Engine, deployment: str
) -> None:
    report = collect_status(engine, effects=None, kafka_config=None)

    assert [(e.effect, e.group, e.applied, e.lag, e.dlq) for e in report.effects] == [
        ("ledger", None, 6, None, None),
        ("retired", None, 1, None, None),
    ]
    assert [t.topic for t in report.topics] == sorted(t.topic for t in report.topics)
    assert len(report.topics) == 2, "only topics with unpublished rows or parked keys"
    assert report.notes[-1] == (
        "no --app: effects are the names found in the receipts; lag and DLQ unknown"
    )
    assert report.relays == {"relay-a": list(LEASED)}


@pytest.fixture
def ledger_target(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--app tests.apps.ledger:effects`` names the test's app (the module is imported afresh
    with its prefixes)."""
    monkeypatch.setenv("ONCELY_TEST_TOPIC_PREFIX", app.registry.topic_prefix)
    monkeypatch.setenv("ONCELY_TEST_GROUP_PREFIX", app.effects.group_prefix)
    monkeypatch.delitem(sys.modules, "tests.apps.ledger")


@pytest.mark.usefixtures("ledger_target")
def test_the_command_prints_json_or_tables_and_never_the_password(
    app: App, database_url: str, kafka_bootstrap: str, deployment: str
) -> None:
    url = make_url(database_url)
    if url.password is None:  # a trust-auth server ignores it; it must still never be shown
        url = url.set(password="not-shown-secret")
    secret = str(url.password)
    common = [
        "--database-url",
        url.render_as_string(hide_password=False),
        "--bootstrap-servers",
        kafka_bootstrap,
        "--app",
        "tests.apps.ledger:effects",
    ]

    as_json = _cli(*common, "--json")
    tables = _cli(*common)

    assert as_json.exit_code == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["database"] == url.render_as_string(hide_password=True)
    assert {e["effect"]: e["lag"] for e in document["effects"]}["ledger"] == 0
    assert tables.exit_code == 0, tables.stderr
    assert "n/a (see /metrics)" in tables.stdout
    assert "relay-a" in tables.stdout and "0-15" in tables.stdout and "16-31" in tables.stdout
    assert f"1 dead row(s) of {app.topic} asked to be requeued or skipped" in tables.stdout
    assert app.registry.topic_prefix in tables.stdout  # long names fold in 80 columns
    assert all(name in tables.stdout for name in app.effects.names())
    assert secret not in as_json.stdout + tables.stdout + as_json.stderr + tables.stderr


def _without_ages(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` without the ages, which grow between two reports."""
    ages = ("oldest_unpublished_seconds", "progress_age_seconds")
    return {
        key: [{k: v for k, v in item.items() if k not in ages} for item in value]
        if key in ("topics", "backlog", "shards")
        else value
        for key, value in document.items()
    }


@pytest.mark.usefixtures("ledger_target")
def test_with_kafka_down_everything_the_database_knows_is_shown_and_one_line_says_so(
    app: App, database_url: str, kafka_bootstrap: str, deployment: str
) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # a closed port: no broker answers there
    common = ["--database-url", database_url, "--app", "tests.apps.ledger:effects"]

    up = _cli(*common, "--bootstrap-servers", kafka_bootstrap, "--json")
    started = time.monotonic()
    down = _cli(*common, "--bootstrap-servers", nobody, "--json")
    took = time.monotonic() - started
    tables = _cli(*common, "--bootstrap-servers", nobody)

    assert (up.exit_code, down.exit_code, tables.exit_code) == (0, 3, 3), down.output
    assert took < KAFKA_SECONDS, "a broker that refuses the connection is not waited out"
    assert f"Kafka gets {KAFKA_SECONDS:g} s" in str(status_command.__doc__)  # as --help says
    # No librdkafka noise, no error line (only the warnings about this test's own variables).
    stderr = (down.stderr + tables.stderr).splitlines()
    assert [line for line in stderr if "ONCELY_TEST_" not in line] == []
    known, partial = json.loads(up.stdout), json.loads(down.stdout)
    why = (
        f"no broker answered at {nobody} (Failed to get metadata: Local: Broker transport failure)"
    )
    assert known.pop("kafka_error") is None
    assert partial.pop("kafka_error") == why
    assert all(isinstance(e["lag"], int) for e in known["effects"] if e["group"])
    unknown = [{**e, "lag": None, "dlq": None} if e["group"] else e for e in known["effects"]]
    # The backlog, the parked keys, the leases, the receipts and the tasks: all there.
    assert _without_ages(partial) == _without_ages({**known, "effects": unknown})
    assert partial["backlog"] and partial["topics"][0]["dead"] == 1
    lines = tables.stdout.splitlines()
    assert [line for line in lines if "Kafka" in line and "unavailable" in line] == [
        f"Kafka unavailable: {why}; the lag and DLQ columns are unknown (?), the rest is the "
        "database's"
    ]
    for shown in ("outbox by topic", "unpublished by topic and shard", "shard leases",
                  "relay-a", "effects", "tasks by state", "asked to be requeued"):  # fmt: skip
        assert shown in tables.stdout


def test_a_broker_that_never_answers_costs_the_status_its_kafka_budget_only(
    app: App, engine: sa.Engine
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, then never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        report = collect_status(
            engine, effects=app.effects, kafka_config={"bootstrap.servers": address}, timeout=2
        )
        took = time.monotonic() - started

    assert report.kafka_error is not None
    assert report.kafka_error.startswith(f"no broker answered at {address} within 2 s (")
    assert took < 5
    assert [(e.lag, e.dlq) for e in report.effects] == [(None, None)] * len(report.effects)
    assert report.tasks and report.shards  # the database's part


@pytest.mark.usefixtures("ledger_target")
def test_listings_plans_and_checks_print_json(
    app: App, database_url: str, kafka_bootstrap: str, deployment: str
) -> None:
    url = ["--database-url", database_url]
    ledger = ["--app", "tests.apps.ledger:effects", "--effect", "ledger"]

    def document(*argv: str) -> Any:
        result = oncely_cli(*argv, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    (dead,) = document("dead", "list", *url)["dead_rows"]
    assert (dead["topic"], dead["held"], dead["request"]) == (app.topic, 2, "requeue")
    requeue = document("dead", "requeue", "--all", *url)
    assert requeue["executed"] is False and [r["id"] for r in requeue["rows"]] == [dead["id"]]
    tasks = document("tasks", "list", *url)["tasks"]
    assert sorted(task["status"] for task in tasks) == ["dead", "queued", "queued"]
    purge = document("relay", "purge", "--older-than", "0s", *url)
    assert purge["executed"] is False
    assert purge["rows"] == sum(topic["rows"] for topic in purge["topics"])
    receipts = document(
        "receipts", "purge", *ledger, "--older-than", "400d", *url,
        "--bootstrap-servers", kafka_bootstrap,
    )  # fmt: skip
    assert receipts == {
        "executed": False, "effect": "ledger", "receipts": 0, "oldest_applied_at": None
    }  # fmt: skip
    plan = document("replay", *ledger, "--to-earliest", "--bootstrap-servers", kafka_bootstrap)
    assert plan["group"] == app.effects.group_id("ledger") and plan["executed"] is False
    assert plan["to_reread"] == sum(p["to_reread"] for p in plan["partitions"]) > 0


def test_status_watch_refreshes_until_ctrl_c(database_url: str) -> None:
    watch = start_oncely(
        *("status", "--database-url", database_url, "--watch", "0.5"),
        stdout=subprocess.PIPE,
        interruptible=True,
    )
    time.sleep(4)
    watch.send_signal(signal.SIGINT)
    stdout, stderr = watch.communicate(timeout=30)
    assert watch.returncode == 0, stderr
    assert "outbox by topic" in stdout and "tasks by state" in stdout
    both = oncely_cli("status", "--database-url", database_url, "--watch", "1", "--json")
    assert both.exit_code == 2
    assert both.stderr.startswith("error: Invalid value for --watch: --watch shows a live table")


def test_each_relay_listed_shows_the_mode_its_heartbeat_wrote(
    engine: sa.Engine, database_url: str
) -> None:
    relays = [
        RelayStore(engine, owner="relay-eos", exactly_once=True),
        RelayStore(engine, owner="relay-alo"),
    ]
    for relay in relays:
        relay.heartbeat(ttl_seconds=60, asleep=False)
        assert len(relay.acquire(wanted=2, lease_seconds=60)) == 2
        relay.close()
    with engine.begin() as conn:  # a lease whose relay's heartbeats are gone
        conn.execute(
            sa.text(
                "UPDATE oncely_relay_shards SET owner = 'relay-gone', "
                "lease_until = now() + interval '1 hour' WHERE shard = 10"
            )
        )

    report = collect_status(engine, effects=None, kafka_config=None)
    assert report.modes == {"relay-eos": True, "relay-alo": False, "relay-gone": None}
    assert {s["owner"]: s["exactly_once"] for s in report.to_json()["shards"] if s["leased"]} == (
        report.modes
    )
    shown = _cli("--database-url", database_url)
    assert shown.exit_code == 0, shown.stderr
    rows = {
        line.split()[1]: line.split()[3] for line in shown.stdout.splitlines() if "relay-" in line
    }
    assert rows == {"relay-alo": "at-least-once", "relay-eos": "exactly-once", "relay-gone": "?"}


def test_a_bad_app_exits_2(database_url: str) -> None:
    result = _cli("--database-url", database_url, "--app", "tests.apps.ledger:nothing")

    assert result.exit_code == 2
    assert "has no attribute" in result.stderr
