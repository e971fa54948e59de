"""`oncely consume` and `oncely replay` as processes, with crashes at the worst moment."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from oncely.devstack._process import free_port
from oncely.schemas.codec import Codec
from tests.apps.ledger import App
from tests.helpers import (
    count_published,
    fast_settings,
    insert_rows,
    oncely_process,
    publish_events,
    running_consumers,
    running_relay,
    scalar,
    staged_rows,
    start_oncely,
    wait_until,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.usefixtures("ledger_tables")]


def _consume(
    app: App, database_url: str, bootstrap: str, effect: str, **env: str
) -> subprocess.Popen[str]:
    return start_oncely(
        *("consume", "tests.apps.ledger:effects", "--effect", effect),
        *("--database-url", database_url, "--bootstrap-servers", bootstrap),
        env={**app.env, "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2", **env},
    )


def _metric(port: int, name: str) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return -1.0
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def _credits(app: App, count: int) -> list[tuple[uuid.UUID, Any]]:
    return [
        (uuid.uuid4(), app.model(account_id=f"acc-{i % 10}", amount=i + 1, n=i))
        for i in range(count)
    ]


def _receipts(engine: sa.Engine, effect: str) -> int:
    count = scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = :e", e=effect)
    assert isinstance(count, int)
    return count


def test_a_consumer_killed_between_db_commit_and_offset_commit_applies_once(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    publish_events(kafka_bootstrap, Codec(registry=app.registry), _credits(app, 50))
    crashing = _consume(
        app,
        database_url,
        kafka_bootstrap,
        "ledger",
        ONCELY_FAILPOINTS="consumer.after_db_commit_before_offset_commit=exit",
        # The survivor gets the partitions once the dead member's session expires: 6 s (the
        # broker's minimum), not the default 45 s.
        ONCELY_CONSUMER_SESSION_TIMEOUT_MS="6000",
    )
    crashing.communicate(timeout=60)
    assert crashing.returncode == 137, "the failpoint ended the process"
    applied_before_crash = _receipts(engine, "ledger")
    assert applied_before_crash > 0, "its transaction committed before it died"

    port = free_port()
    survivor = _consume(
        app, database_url, kafka_bootstrap, "ledger", ONCELY_CONSUMER_METRICS_PORT=str(port)
    )
    try:
        # Everything it receives again was applied before the crash: suppressed, not re-applied.
        wait_until(lambda: _receipts(engine, "ledger") == 50, timeout=60)
        wait_until(
            lambda: (
                _metric(port, "oncely_consumer_duplicates_suppressed_total") == applied_before_crash
            ),
            timeout=60,
        )
        assert _metric(port, "oncely_consumer_applied_total") == 50 - applied_before_crash
    finally:
        survivor.send_signal(signal.SIGTERM)
        _, stderr = survivor.communicate(timeout=60)
    assert survivor.returncode == 0, stderr
    assert scalar(engine, "SELECT count(*) FROM ledger") == 50, "no effect applied twice"


@pytest.mark.parametrize("effect", ["ledger", "ledger.batch", "ledger.async"])
def test_replay_to_earliest_rereads_everything_and_applies_nothing_new(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str, effect: str
) -> None:
    publish_events(kafka_bootstrap, Codec(registry=app.registry), _credits(app, 1000))
    with running_consumers(app.effects, [effect], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _receipts(engine, effect) == 1000, timeout=90)
    command = [
        *("replay", "--app", "tests.apps.ledger:effects", "--effect", effect, "--to-earliest"),
        *("--bootstrap-servers", kafka_bootstrap),
    ]
    dry = oncely_process(*command, env=app.env, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: 1000 record(s) would be re-read" in dry.stdout
    done = oncely_process(*command, "--execute", env=app.env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "1000 record(s) will be re-read" in done.stdout

    with running_consumers(app.effects, [effect], engine, kafka_bootstrap) as [consumer]:
        wait_until(
            lambda: (
                (
                    consumer.metrics.registry.get_sample_value(
                        "oncely_consumer_duplicates_suppressed_total", {"effect": effect}
                    )
                    or 0
                )
                == 1000
            ),
            timeout=90,
        )
        refused = oncely_process(*command, "--execute", env=app.env, timeout=60)
    assert refused.returncode == 2
    assert "active member" in refused.stderr
    assert scalar(engine, "SELECT count(*) FROM ledger WHERE effect = :e", e=effect) == 1000, (
        "nothing applied twice"
    )


def test_replay_from_outbox_republishes_with_the_same_ids(
    app: App, engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    insert_rows(engine, staged_rows(Codec(registry=app.registry), _credits(app, 200)))
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    with (
        running_relay(engine, kafka_bootstrap, fast_settings()),
        running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap) as [consumer],
    ):
        wait_until(lambda: _receipts(engine, "ledger") == 200, timeout=90)
        result = oncely_process(
            *("replay", "--from-outbox", "--since", since, "--type", "account.credited"),
            *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
            "--execute",
        )
        assert result.returncode == 0, result.stderr
        assert f"republished 200 row(s) with their original event ids ({app.topic}: 200)" in (
            result.stdout
        )
        wait_until(
            lambda: (
                (
                    consumer.metrics.registry.get_sample_value(
                        "oncely_consumer_duplicates_suppressed_total", {"effect": "ledger"}
                    )
                    or 0
                )
                == 200
            ),
            timeout=90,
        )
    assert count_published(engine) == 200
    assert scalar(engine, "SELECT count(*) FROM ledger") == 200, "receipts absorbed the replay"
