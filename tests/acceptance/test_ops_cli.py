"""`oncely status` and `oncely verify` as processes against a small real deployment."""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from oncely.ops.status import DUPLICATES_NOTE
from oncely.schemas.codec import Codec
from oncely.storage import outbox
from oncely.storage.tables import shard_of
from tests.apps.ledger import App
from tests.helpers import (
    acknowledge_all,
    count_published,
    effect_status,
    fast_settings,
    insert_rows,
    oncely_process,
    outbox_row,
    park,
    publish_events,
    running_consumers,
    running_relay,
    scalar,
    staged_rows,
    wait_until,
)

LEDGER = "tests.apps.ledger:effects"

pytestmark = [pytest.mark.acceptance, pytest.mark.usefixtures("ledger_tables")]


def test_status_json_of_a_small_deployment(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    dead = outbox_row(app.topic)
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox).values(**dead))
    with engine.begin() as conn:  # the relay passed the dead row and parked its key
        acknowledge_all(conn)
        park(conn, dead)
    unpublished = outbox_row(app.topic, "acc-1")
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox).values(**unpublished))
    events = [(uuid.uuid4(), app.model(account_id=f"acc-{n}", amount=1, n=n)) for n in range(3)]
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)

    result = oncely_process(
        *("status", "--json", "--app", LEDGER, "--database-url", database_url),
        *("--bootstrap-servers", kafka_bootstrap),
        env=app.env,
    )

    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    oldest = document["topics"][0]["oldest_unpublished_seconds"]
    assert oldest == pytest.approx(0, abs=30)
    shard = shard_of(app.topic, "acc-1", 32)
    shards = document.pop("shards")
    assert all(s.pop("progress_age_seconds") >= 0 for s in shards)
    assert shards == [
        {
            "shard": n,
            "owner": None,
            "epoch": 0,
            "leased": False,
            "unpublished": int(n == shard),
            "oldest_unpublished_seconds": oldest if n == shard else None,
            "exactly_once": None,  # no relay: no mode
        }
        for n in range(32)
    ]
    assert document == {
        "database": sa.make_url(database_url).render_as_string(hide_password=True),
        "topics": [
            {
                "topic": app.topic,
                "unpublished": 1,
                "oldest_unpublished_seconds": oldest,
                "dead": 1,
                "delayed": 0,
                "held_keys": 1,
                "held_rows": 0,
                "requested": 0,
                "blocked_rows": 0,
                "blocked_since": None,
                "blocked_error": None,
            }
        ],
        "backlog": [
            {
                "topic": app.topic,
                "shard": shard,
                "unpublished": 1,
                "oldest_unpublished_seconds": oldest,
            }
        ],
        "effects": [effect_status(app, name, lag=3) for name in app.effects.names()],
        "tasks": dict.fromkeys(
            ["queued", "leased", "completed", "dead", "failed", "stale", "expired"], 0
        ),
        "notes": [
            DUPLICATES_NOTE,
            f"1 shard(s) with unpublished rows are held by no relay ({shard}): "
            "is `oncely relay run` running?",
        ],
        "kafka_error": None,
        # Every row is younger than the grace period: nothing is checked yet, nothing missing.
        "completeness": [
            {
                "effect": name,
                "missing": 0,
                "oldest_missing_at": None,
                "window_start": None,
                "window_end": None,
                "sample_ids": [],
                "buckets": 0,
                "buckets_read": 0,
            }
            for name in sorted(app.effects.names())
        ],
    }


def test_verify_passes_on_a_healthy_pipeline_and_fails_when_an_effect_missed_an_event(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    events = [
        (uuid.uuid4(), app.model(account_id=f"acc-{n % 5}", amount=1, n=n)) for n in range(20)
    ]
    rows = staged_rows(Codec(registry=app.registry), events)
    insert_rows(engine, rows)
    with (
        running_relay(engine, kafka_bootstrap, fast_settings()),
        running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap),
    ):
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 20, timeout=90)
    assert count_published(engine) == 20
    command = [
        *("verify", "--app", LEDGER, "--since", "10m", "--effect", "ledger", "--json"),
        *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
    ]

    healthy = oncely_process(*command, env=app.env)
    with engine.begin() as conn:
        conn.execute(
            sa.text("DELETE FROM oncely_receipts WHERE event_id = :id"), {"id": rows[7]["id"]}
        )
    damaged = oncely_process(*command, env=app.env)

    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert json.loads(healthy.stdout)["kafka"] == {"checked": 20, "lost": 0}
    assert damaged.returncode == 1, damaged.stderr
    report = json.loads(damaged.stdout)
    assert report["problems"] == {"lost": 0, "not_applied": 1, "out_of_order": 0, "stuck": 0}
    assert report["effects"][0]["not_applied_ids"] == [str(rows[7]["id"])]
