"""Completeness against real PostgreSQL: which events count as missing for an effect, and the
consumer process exporting ``oncely_effect_missing_events`` from a real pipeline."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from oncely.consumers.completeness import EffectCompleteness, check_effect
from oncely.devstack._process import free_port
from oncely.ids import millis_of
from oncely.schemas.codec import Codec
from oncely.settings import CompletenessSettings
from oncely.storage.stores import dead_lettered
from tests.apps.ledger import App
from tests.helpers import (
    acknowledge_all,
    execute,
    fast_settings,
    insert_rows,
    metric,
    outbox_row,
    park,
    running_relay,
    scalar,
    start_oncely,
    wait_ready,
    wait_until,
)
from tests.helpers.outbox import uuid7_at

pytestmark = pytest.mark.integration

TOPIC = "accounts"
TYPE = "account.credited"
EFFECT = "ledger"
SETTINGS = CompletenessSettings(grace_seconds=300, bucket_seconds=60, window_seconds=86400)


def _now(engine: sa.Engine) -> datetime:
    moment: datetime = scalar(engine, "SELECT now()")
    return moment


def _row(engine: sa.Engine, age: timedelta, key: str, **columns: object) -> dict[str, object]:
    """An outbox row of ``TYPE`` staged ``age`` ago (by its id's time)."""
    event_id = uuid7_at(_now(engine) - age)
    return outbox_row(TOPIC, key, event_id=event_id, **{"type": TYPE, **columns})


def _receipt(engine: sa.Engine, row: dict[str, object], effect: str = EFFECT) -> None:
    execute(
        engine,
        "INSERT INTO oncely_receipts (event_id, effect) VALUES (:e, :f)",
        e=row["id"],
        f=effect,
    )


def _check(engine: sa.Engine, settings: CompletenessSettings = SETTINGS) -> EffectCompleteness:
    with engine.connect() as conn, conn.begin():
        return check_effect(conn, effect=EFFECT, types=[TYPE], settings=settings)


def test_only_published_events_of_its_types_past_the_grace_period_without_receipt_are_missing(
    engine: sa.Engine,
) -> None:
    old = timedelta(minutes=10)
    missing = _row(engine, timedelta(hours=2), "a")  # the oldest row kept: the window's start
    applied = _row(engine, old, "b")
    other_type = _row(engine, old, "c", type="account.debited")
    young = _row(engine, timedelta(minutes=1), "d")  # within the grace period
    dead = _row(engine, old, "e")
    held = _row(engine, old, "e")  # behind the dead row of its key
    skipped = _row(engine, old, "f")
    dead_lettered_row = _row(engine, old, "g")
    applied_after_dlq = _row(engine, old, "h")
    missing_too = _row(engine, old, "i")
    rows = [
        missing,
        applied,
        other_type,
        young,
        dead,
        held,
        skipped,
        dead_lettered_row,
        applied_after_dlq,
        missing_too,
    ]
    insert_rows(engine, rows)
    acknowledge_all(engine)  # all published, as far as the relay's progress says
    unpublished = _row(engine, old, "j")  # committed after the progress: not published yet
    insert_rows(engine, [unpublished])
    _receipt(engine, applied)
    _receipt(engine, missing, effect="audit")  # another effect's receipt does not count
    _receipt(engine, applied_after_dlq)
    park(engine, dead, "dead", held=[held])
    execute(
        engine,
        "INSERT INTO oncely_relay_skipped (event_id, topic, aggregateid) VALUES (:e, :t, 'f')",
        e=skipped["id"],
        t=TOPIC,
    )
    for row in (dead_lettered_row, applied_after_dlq):
        dead_lettered.record(
            engine,
            effect=EFFECT,
            event_id=row["id"],  # type: ignore[arg-type]
            topic=TOPIC,
            partition=0,
            offset=1,
            reason="handler_failed",
        )

    checked = _check(engine)

    assert checked.missing == 2
    assert checked.sample_ids == [missing["id"], missing_too["id"]]
    assert checked.oldest_missing_at is not None
    assert checked.window_start is not None and checked.window_end is not None
    oldest_ms = millis_of(missing["id"])  # type: ignore[arg-type]
    assert checked.window_start.timestamp() * 1000 == pytest.approx(oldest_ms, abs=1)
    assert checked.window_end <= _now(engine) - timedelta(seconds=SETTINGS.grace_seconds)
    assert checked.buckets >= 110  # two hours of one-minute buckets, a few read row by row
    assert checked.buckets_read <= 3

    few = _check(engine, CompletenessSettings(sample_size=1))
    assert (few.missing, few.sample_ids) == (2, [missing["id"]])
    # Once applied, the events are no longer missing; the young one is, once past the grace.
    _receipt(engine, missing)
    _receipt(engine, missing_too)
    assert _check(engine).missing == 0
    assert _check(engine, CompletenessSettings(grace_seconds=0)).sample_ids == [young["id"]]


def test_the_window_is_empty_while_every_row_is_within_the_grace_period(
    engine: sa.Engine,
) -> None:
    assert _check(engine) == EffectCompleteness(EFFECT, 0, None, None, None)  # no rows
    insert_rows(engine, [_row(engine, timedelta(seconds=30), "a")])
    acknowledge_all(engine)
    assert _check(engine) == EffectCompleteness(EFFECT, 0, None, None, None)


@pytest.mark.usefixtures("ledger_tables")
def test_the_consumer_process_exports_missing_events_and_counts_its_dead_letters_as_dead(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_ledger: Callable[..., App],
    tmp_path: Path,
) -> None:
    app = new_ledger()
    codec = Codec(registry=app.registry)

    def staged(n: int, amount: int) -> dict[str, object]:
        event = app.model(account_id=f"acc-{n}", amount=amount, n=n)
        value, headers = codec.encode(event)
        return outbox_row(
            app.topic, event.account_id, type="account.credited", payload=value, headers=headers
        )

    # Published as far as the relay's progress says, but never sent: the consumer never sees it.
    lost = staged(0, 1)
    insert_rows(engine, [lost])
    acknowledge_all(engine)
    good, bad = staged(1, 5), staged(2, -5)  # the ledger's handler refuses a negative amount
    insert_rows(engine, [good, bad])
    port = free_port()
    log = (tmp_path / "consumer.log").open("w")
    consumer = start_oncely(
        *("consume", "--app", "tests.apps.ledger:effects", "--effect", "ledger"),
        *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
        *("--metrics-port", str(port)),
        env={
            **app.env,
            "ONCELY_COMPLETENESS_INTERVAL_SECONDS": "0.5",
            "ONCELY_COMPLETENESS_GRACE_SECONDS": "0",
            "ONCELY_COMPLETENESS_BUCKET_SECONDS": "1",
        },
        stderr=log,
    )
    try:
        wait_ready(port, consumer, timeout=60)
        with running_relay(engine, kafka_bootstrap, fast_settings()):
            wait_until(
                lambda: scalar(engine, "SELECT count(*) FROM oncely_dead_lettered") == 1,
                timeout=90,
            )
        assert scalar(engine, "SELECT event_id FROM oncely_dead_lettered") == bad["id"]
        assert scalar(engine, "SELECT event_id FROM oncely_receipts") == good["id"]
        series = 'oncely_effect_missing_events{effect="ledger"}'
        wait_until(lambda: metric(port, series) == 1, timeout=30)  # the lost one only
        assert metric(port, 'oncely_effect_completeness_check_seconds{effect="ledger"}') > 0
        execute(
            engine,
            "INSERT INTO oncely_receipts (event_id, effect) VALUES (:e, 'ledger')",
            e=lost["id"],
        )
        wait_until(lambda: metric(port, series) == 0, timeout=30)
    finally:
        consumer.terminate()
        try:
            consumer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            consumer.kill()
            consumer.wait()
        log.close()
