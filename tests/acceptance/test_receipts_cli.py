"""`oncely receipts purge` refuses horizons shorter than the topics' retention."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import NewTopic

from tests.apps.ledger import build
from tests.helpers import oncely_process, scalar

pytestmark = pytest.mark.acceptance


def test_purge_is_refused_within_retention_and_deletes_old_receipts(
    database_url: str, kafka_bootstrap: str, kafka_admin: Any
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    app = build(prefix)
    topic = NewTopic(app.topic, num_partitions=1, config={"retention.ms": str(3 * 86400_000)})
    kafka_admin.create_topics([topic])[app.topic].result(30)
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        for age in (1, 5, 10):
            conn.execute(
                sa.text(
                    "INSERT INTO oncely_receipts (event_id, effect, applied_at)"
                    " VALUES (:e, 'ledger', now() - make_interval(days => :d))"
                ),
                {"e": uuid.uuid4(), "d": age},
            )
    command = [
        *("receipts", "purge", "--app", "tests.apps.ledger:effects", "--effect", "ledger"),
        *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
    ]
    env = {"ONCELY_TEST_TOPIC_PREFIX": prefix}
    refused = oncely_process(*command, "--older-than", "2d", env=env, timeout=60)
    assert refused.returncode == 1
    assert "replay could apply those events twice" in refused.stderr
    refused = oncely_process(*command, "--older-than", "2d", "--execute", env=env, timeout=60)
    assert refused.returncode == 1
    assert "replay could apply those events twice" in refused.stderr
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 3
    dry_run = oncely_process(*command, "--older-than", "4d", env=env, timeout=60)
    assert dry_run.returncode == 0, dry_run.stderr
    assert "would delete 2 receipt(s) of ledger older than 4d, oldest applied " in dry_run.stdout
    assert "dry run: nothing changed; run again with --execute" in dry_run.stdout
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 3
    done = oncely_process(*command, "--older-than", "4d", "--execute", env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "deleted 2 receipt(s) of ledger older than 4d" in done.stdout
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 1
    engine.dispose()
