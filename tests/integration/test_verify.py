"""``oncely verify`` against a real pipeline: outbox -> relay -> Kafka -> effects, then damage."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from oncely.ops.verify import Report, verify_window
from oncely.schemas.codec import Codec
from oncely.storage import outbox, receipts
from oncely.storage.tables import shard_of
from tests.apps.ledger import App
from tests.helpers import (
    CliResult,
    count_published,
    fast_settings,
    oncely_cli,
    outbox_row,
    read_topics,
    running_consumers,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]

EVENTS = 12  # three per key: acc-0 .. acc-3
EFFECTS = ["ledger", "audit"]


@pytest.fixture
def app(new_ledger: Callable[..., App]) -> App:
    """Not the shared ``app``: without the ``ways`` variants of ledger and notify, effects
    that verify, checking every effect of the app, would report."""
    return new_ledger(2)


@pytest.fixture
def since() -> datetime:
    return datetime.now(UTC) - timedelta(minutes=10)


@pytest.fixture
def pipeline(app: App, engine: sa.Engine, kafka_bootstrap: str) -> list[uuid.UUID]:
    """Stage EVENTS events, relay them, apply them with EFFECTS; their ids in seq order."""
    codec = Codec(registry=app.registry)
    rows = []
    for n in range(EVENTS):
        event = app.model(account_id=f"acc-{n % 4}", amount=n + 1, n=n)
        value, headers = codec.encode(event)
        rows.append(outbox_row(app.topic, event.account_id, payload=value, headers=headers))
    with engine.begin() as conn:
        for row in rows:  # one statement each: seq follows n
            conn.execute(sa.insert(outbox).values(**row))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == EVENTS, timeout=60)
    with running_consumers(app.effects, EFFECTS, engine, kafka_bootstrap):
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 2 * EVENTS,
            timeout=60,
        )
    return [row["id"] for row in rows]


def _acknowledge(engine: sa.Engine) -> None:
    """What a relay records once every row committed so far is acknowledged."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE oncely_relay_shards SET done = pg_current_snapshot()"))


def _verify(app: App, engine: sa.Engine, bootstrap: str, since: datetime, **kw: Any) -> Report:
    effects = [app.effects.get(name) for name in EFFECTS]
    return verify_window(
        engine,
        kafka_config={"bootstrap.servers": bootstrap},
        effects=effects,
        since=since,
        timeout=15,
        **kw,
    )


@pytest.fixture
def verify_cli(
    app: App, database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., CliResult]:
    """``oncely verify`` of the app's EFFECTS against this database and broker, in this process."""

    def run(*args: str) -> CliResult:
        monkeypatch.setenv("ONCELY_TEST_TOPIC_PREFIX", app.registry.topic_prefix)
        monkeypatch.setenv("ONCELY_TEST_GROUP_PREFIX", app.effects.group_prefix)
        monkeypatch.delitem(sys.modules, "tests.apps.ledger")  # re-imported with the env above
        return oncely_cli(
            *("verify", "--app", "tests.apps.ledger:effects", "--database-url", database_url),
            *("--bootstrap-servers", kafka_bootstrap),
            *(option for effect in EFFECTS for option in ("--effect", effect)),
            *args,
        )

    return run


def test_a_clean_window_verifies_and_the_command_exits_0(
    since: datetime, pipeline: list[uuid.UUID], verify_cli: Callable[..., CliResult]
) -> None:
    result = verify_cli("--since", since.isoformat(), "--json")

    assert result.exit_code == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["outbox"] == {
        "committed": EVENTS,
        "published": EVENTS,
        "unpublished": 0,
        "dead": 0,
        "held": 0,
        "stuck": 0,
        "oldest_unpublished_seconds": None,
    }
    assert document["kafka"] == {"checked": EVENTS, "lost": 0}
    assert [(e["effect"], e["expected"], e["applied"]) for e in document["effects"]] == [
        ("ledger", EVENTS, EVENTS),
        ("audit", EVENTS, EVENTS),
    ]
    assert document["problems"] == {"lost": 0, "not_applied": 0, "out_of_order": 0, "stuck": 0}
    assert document["ok"] is True
    assert set(document) == {
        "database",
        "since",
        "until",
        "max_pending_age_seconds",
        "outbox",
        "kafka",
        "effects",
        "stuck",
        "lost",
        "problems",
        "ok",
        "notes",
    }


def test_receipts_of_one_event_under_other_effect_names_are_not_duplicates(
    app: App, engine: sa.Engine, kafka_bootstrap: str, since: datetime, pipeline: list[uuid.UUID]
) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.insert(receipts),
            [
                {"event_id": pipeline[0], "effect": "bookkeeping"},
                {"event_id": pipeline[0], "effect": "reporting"},
                {"event_id": uuid.uuid4(), "effect": "ledger"},  # not an event of the window
            ],
        )

    report = _verify(app, engine, kafka_bootstrap, since)

    assert report.ok, report.problems
    assert [e.applied for e in report.effects] == [EVENTS, EVENTS]


def test_published_rows_missing_from_their_topic_are_lost(
    app: App,
    engine: sa.Engine,
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    since: datetime,
    pipeline: list[uuid.UUID],
) -> None:
    records = read_topics(kafka_bootstrap, [app.topic])
    partition = min(r.partition for r in records)
    first = sorted((r for r in records if r.partition == partition), key=lambda r: r.offset)
    ids = [r.headers["id"].decode() for r in records]
    deleted = [uuid.UUID(r.headers["id"].decode()) for r in first[:2]]
    assert all(ids.count(str(i)) == 1 for i in deleted), "no other copy of them"
    # The first two records of one partition are deleted from the log.
    futures = kafka_admin.delete_records([TopicPartition(app.topic, partition, 2)])
    for future in futures.values():
        future.result(30)
    # Rows the progress passed but whose records never reached Kafka: one of the app's topic,
    # one of a topic that does not exist.
    never_sent = outbox_row(app.topic, "acc-5")
    no_topic = outbox_row(f"{app.topic}.missing", "acc-6")
    with engine.begin() as conn:
        for row in (never_sent, no_topic):
            conn.execute(sa.insert(outbox).values(**row))
    _acknowledge(engine)

    report = _verify(app, engine, kafka_bootstrap, since)

    lost = {(r.id, r.topic, r.reason) for r in report.lost_records}
    assert lost == {
        (deleted[0], app.topic, "missing"),
        (deleted[1], app.topic, "missing"),
        (never_sent["id"], app.topic, "missing"),
        (no_topic["id"], no_topic["topic"], "topic_missing"),
    }
    assert (report.checked, report.lost, report.outbox.published) == (EVENTS + 2, 4, EVENTS + 2)
    assert report.problems["lost"] == 4
    assert len(_verify(app, engine, kafka_bootstrap, since, limit=1).lost_records) == 1


def test_an_effect_applied_out_of_order_or_not_at_all_is_reported(
    app: App,
    engine: sa.Engine,
    kafka_bootstrap: str,
    since: datetime,
    pipeline: list[uuid.UUID],
    verify_cli: Callable[..., CliResult],
) -> None:
    key_events = pipeline[1::4]  # acc-1's three events, in seq order
    with engine.begin() as conn:
        # ledger applied acc-1's events in reverse: each after the next one.
        conn.execute(
            sa.text(
                "UPDATE oncely_receipts SET applied_at = now() - make_interval(secs => :rank)"
                " WHERE event_id = :id AND effect = 'ledger'"
            ),
            [{"id": event_id, "rank": rank} for rank, event_id in enumerate(key_events)],
        )
        conn.execute(
            sa.text("DELETE FROM oncely_receipts WHERE event_id = :id AND effect = 'audit'"),
            {"id": pipeline[5]},
        )

    report = _verify(app, engine, kafka_bootstrap, since)
    result = verify_cli("--since", "15m")

    ledger, audit = report.effects
    assert (ledger.out_of_order, ledger.not_applied) == (2, 0)
    assert [(o.id, o.previous_id) for o in ledger.out_of_order_ids] == [
        (key_events[1], key_events[0]),
        (key_events[2], key_events[1]),
    ]
    assert (audit.out_of_order, audit.not_applied, audit.not_applied_ids) == (0, 1, [pipeline[5]])
    assert report.problems == {"lost": 0, "not_applied": 1, "out_of_order": 2, "stuck": 0}
    unlisted = _verify(app, engine, kafka_bootstrap, since, limit=0)
    assert unlisted.problems == report.problems, "counts do not depend on the listed ids"
    assert [(e.not_applied_ids, e.out_of_order_ids) for e in unlisted.effects] == [([], [])] * 2
    assert result.exit_code == 1, result.stdout + result.stderr
    assert f"not applied by audit: {pipeline[5]}" in result.stdout
    assert f"out of order in ledger: {key_events[1]} applied before {key_events[0]}" in (
        result.stdout
    )


def test_rows_not_passed_yet_are_unpublished_and_stuck_only_past_the_threshold(
    app: App, engine: sa.Engine, kafka_bootstrap: str, since: datetime, pipeline: list[uuid.UUID]
) -> None:
    five_minutes_ago = sa.text("now() - interval '5 minutes'")
    due = {"created_at": five_minutes_ago, "available_at": five_minutes_ago}
    dead = outbox_row(app.topic, "acc-7", **due)
    with engine.begin() as conn:
        conn.execute(sa.insert(outbox).values(**dead))
    _acknowledge(engine)
    with engine.begin() as conn:  # the relay parked the key of a row that failed for good
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, "
                "error) VALUES (:t, 'acc-7', :s, :e, 'dead', 'broker said no')"
            ),
            {"t": app.topic, "s": shard_of(app.topic, "acc-7", 32), "e": dead["id"]},
        )
    old = outbox_row(app.topic, "acc-9", **due)
    fresh = outbox_row(app.topic, "acc-8")
    delayed = outbox_row(
        app.topic,
        "acc-6",
        created_at=five_minutes_ago,
        available_at=sa.text("now() + interval '1 hour'"),
    )
    with engine.begin() as conn:  # no relay runs: not passed by the progress
        for row in (old, fresh, delayed):
            conn.execute(sa.insert(outbox).values(**row))

    report = _verify(app, engine, kafka_bootstrap, since, max_pending_age_seconds=60)

    o = report.outbox
    assert (o.committed, o.published, o.unpublished, o.dead, o.held) == (
        EVENTS + 4,
        EVENTS,
        3,
        1,
        0,
    )
    assert o.stuck == 2, "the old unpublished row and the dead one; not the fresh or the delayed"
    assert [(s.id, s.state, s.error) for s in report.stuck_rows] == [
        (dead["id"], "dead", "broker said no"),
        (old["id"], "unpublished", None),
    ]
    assert report.stuck_rows[0].age_seconds == pytest.approx(300, abs=60)
    assert o.oldest_unpublished_seconds == pytest.approx(300, abs=60)
    assert (report.checked, report.lost) == (EVENTS, 0), "unpublished rows are not lost"
    assert report.problems == {"lost": 0, "not_applied": 0, "out_of_order": 0, "stuck": 2}
    assert not report.ok
    assert any("3 row(s) of the window are not published yet" in n for n in report.notes)
    # With a window that ends before them, the five-minute-old rows are out of scope.
    assert (
        _verify(
            app, engine, kafka_bootstrap, since, until=datetime.now(UTC) - timedelta(minutes=4)
        ).outbox.committed
        == 3
    )


class _CountingConsumer(Consumer):
    """Counts the records verify receives."""

    received = 0

    def consume(self, *args: Any, **kwargs: Any) -> list[Any]:
        messages = super().consume(*args, **kwargs)
        _CountingConsumer.received += sum(1 for m in messages if m.error() is None)
        return messages


def test_records_older_than_the_window_are_not_read(
    app: App,
    engine: sa.Engine,
    kafka_bootstrap: str,
    since: datetime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10,000 records stamped before --since, then the window's: only the window's are read."""
    monkeypatch.setattr("oncely.ops.verify.Consumer", _CountingConsumer)
    monkeypatch.setattr(_CountingConsumer, "received", 0)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    before = int((since - timedelta(hours=1)).timestamp() * 1000)
    for _ in range(10_000):
        producer.produce(
            app.topic,
            key=b"acc-0",
            value=b"{}",
            partition=0,
            timestamp=before,
            headers=[("id", str(uuid.uuid4()))],
        )
    rows = [outbox_row(app.topic, "acc-0") for _ in range(4)]
    with engine.begin() as conn:
        for row in rows:
            conn.execute(sa.insert(outbox).values(**row))
    _acknowledge(engine)
    for row in rows:  # as the relay sends them: timestamp = created_at (now)
        producer.produce(
            app.topic, key=b"acc-0", value=b"{}", partition=0, headers=[("id", str(row["id"]))]
        )
    assert producer.flush(30) == 0

    report = verify_window(
        engine,
        kafka_config={"bootstrap.servers": kafka_bootstrap},
        effects=[],
        since=since,
        timeout=15,
    )

    assert (report.checked, report.lost, report.outbox.published) == (4, 0, 4)
    assert _CountingConsumer.received < 5000, "the read started at --since"
