"""``oncely verify`` against a real pipeline: outbox -> relay -> Kafka -> effects, then damage."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
import typer
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner, Result

from oncely.cli.verify import verify
from oncely.ops.verify import Report, verify_window
from oncely.schemas.codec import Codec
from oncely.storage import outbox, receipts
from tests.apps.ledger import App, build, create_tables
from tests.helpers import fast_settings, running_consumers, running_relay, scalar, wait_until

pytestmark = pytest.mark.integration

EVENTS = 12  # three per key: acc-0 .. acc-3
EFFECTS = ["ledger", "audit"]


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def app(kafka_admin: AdminClient) -> Iterator[App]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    app = build(prefix, group_prefix=prefix)
    kafka_admin.create_topics([NewTopic(app.topic, num_partitions=2)])[app.topic].result(30)
    yield app
    kafka_admin.delete_topics([app.topic])[app.topic].result(30)


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
        rows.append(_row(app, event.account_id, payload=value, headers=headers))
    with engine.begin() as conn:
        for row in rows:  # one statement each: seq follows n
            conn.execute(sa.insert(outbox).values(**row))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: _count(engine, "status = 'published'") == EVENTS, timeout=60)
    with running_consumers(app.effects, EFFECTS, engine, kafka_bootstrap):
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 2 * EVENTS,
            timeout=60,
        )
    return [row["id"] for row in rows]


def _row(app: App, key: str, **columns: Any) -> dict[str, Any]:
    event_id = uuid.uuid4()
    return {
        "id": event_id,
        "aggregatetype": "account",
        "aggregateid": key,
        "type": "account.credited",
        "topic": app.topic,
        "payload": b"{}",
        "headers": {},
        "event_key": str(event_id),
        **columns,
    }


def _count(engine: sa.Engine, where: str) -> int:
    value = scalar(engine, f"SELECT count(*) FROM oncely_outbox WHERE {where}")
    assert isinstance(value, int)
    return value


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


def _cli(app: App, monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    monkeypatch.setenv("ONCELY_TEST_TOPIC_PREFIX", app.registry.topic_prefix)
    monkeypatch.setenv("ONCELY_TEST_GROUP_PREFIX", app.effects.group_prefix)
    monkeypatch.delitem(sys.modules, "tests.apps.ledger")  # re-imported with the env above
    command = typer.Typer()
    command.command()(verify)
    return CliRunner().invoke(command, ["--app", "tests.apps.ledger:effects", *args])


def test_a_clean_window_verifies_and_the_command_exits_0(
    app: App,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    since: datetime,
    pipeline: list[uuid.UUID],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _cli(
        app,
        monkeypatch,
        "--since",
        since.isoformat(),
        "--database-url",
        database_url,
        "--bootstrap-servers",
        kafka_bootstrap,
        *("--effect", "ledger", "--effect", "audit", "--json"),
    )

    assert result.exit_code == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["outbox"] == {
        "committed": EVENTS,
        "published": EVENTS,
        "pending": 0,
        "dead": 0,
        "skipped": 0,
        "stuck": 0,
        "unlocated": 0,
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


def test_deleted_and_misplaced_kafka_records_are_lost(
    app: App,
    engine: sa.Engine,
    kafka_admin: AdminClient,
    kafka_bootstrap: str,
    since: datetime,
    pipeline: list[uuid.UUID],
) -> None:
    with engine.connect() as conn:
        placed = conn.execute(
            sa.text(
                "SELECT id, kafka_partition, kafka_offset FROM oncely_outbox"
                " ORDER BY kafka_partition, kafka_offset"
            )
        ).all()
    by_partition: dict[int, list[Any]] = {}
    for row in placed:
        by_partition.setdefault(row.kafka_partition, []).append(row)
    first, second = (by_partition[p] for p in sorted(by_partition))
    assert len(first) >= 3 and len(second) >= 2, "keys spread over both partitions"
    # The first two records of one partition are deleted from the log.
    deleted = kafka_admin.delete_records([TopicPartition(app.topic, first[0].kafka_partition, 2)])
    for future in deleted.values():
        future.result(30)
    # One row points at its neighbour's record, another past the end of its partition.
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE oncely_outbox SET kafka_offset = :o WHERE id = :id"),
            [
                {"id": second[0].id, "o": second[1].kafka_offset},
                {"id": first[2].id, "o": 1000},
            ],
        )

    report = _verify(app, engine, kafka_bootstrap, since)

    lost = {(r.id, r.reason, r.found_id) for r in report.lost_records}
    assert lost == {
        (first[0].id, "deleted", None),
        (first[1].id, "deleted", None),
        (first[2].id, "missing", None),
        (second[0].id, "id_mismatch", str(second[1].id)),
    }
    assert (report.checked, report.lost) == (EVENTS, 4)
    assert report.problems == {"lost": 4, "not_applied": 0, "out_of_order": 0, "stuck": 0}


def test_an_effect_applied_out_of_order_or_not_at_all_is_reported(
    app: App,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    since: datetime,
    pipeline: list[uuid.UUID],
    monkeypatch: pytest.MonkeyPatch,
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
    result = _cli(
        app,
        monkeypatch,
        *("--since", "15m", "--database-url", database_url),
        *("--bootstrap-servers", kafka_bootstrap, "--effect", "ledger", "--effect", "audit"),
    )

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


def test_an_unpublished_row_older_than_the_threshold_is_stuck(
    app: App, engine: sa.Engine, kafka_bootstrap: str, since: datetime, pipeline: list[uuid.UUID]
) -> None:
    later = sa.text("now() + interval '1 hour'")
    old = _row(app, "acc-9", created_at=sa.text("now() - interval '5 minutes'"), available_at=later)
    fresh = _row(app, "acc-8", available_at=later)
    dead = _row(app, "acc-7", status="dead", last_error="broker said no")
    with engine.begin() as conn:
        for row in (old, fresh, dead):
            conn.execute(sa.insert(outbox).values(**row))

    report = _verify(app, engine, kafka_bootstrap, since, max_pending_age_seconds=60)

    assert (report.outbox.pending, report.outbox.dead, report.outbox.stuck) == (2, 1, 1)
    assert [(s.id, s.status) for s in report.stuck_rows] == [(old["id"], "pending")]
    assert report.stuck_rows[0].age_seconds == pytest.approx(300, abs=60)
    assert report.outbox.oldest_unpublished_seconds == pytest.approx(300, abs=60)
    assert report.problems == {"lost": 0, "not_applied": 0, "out_of_order": 0, "stuck": 1}
    assert not report.ok
    # With a window that ends before it, the old row is out of scope.
    assert (
        _verify(
            app, engine, kafka_bootstrap, since, until=datetime.now(UTC) - timedelta(minutes=4)
        ).outbox.committed
        == 1
    )


class _CountingConsumer(Consumer):
    """Counts the records verify receives."""

    received = 0

    def consume(self, *args: Any, **kwargs: Any) -> list[Any]:
        messages = super().consume(*args, **kwargs)
        _CountingConsumer.received += sum(1 for m in messages if m.error() is None)
        return messages


def test_records_far_apart_in_a_partition_are_found_by_seeking(
    app: App,
    engine: sa.Engine,
    kafka_bootstrap: str,
    since: datetime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows at offsets 0, 1 and past a 10,000-record gap: verified without reading the gap."""
    monkeypatch.setattr("oncely.ops.verify.Consumer", _CountingConsumer)
    monkeypatch.setattr(_CountingConsumer, "received", 0)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    ids = [uuid.uuid4() for _ in range(12_000)]
    placed: list[tuple[int, int]] = []
    for event_id in ids:
        producer.produce(
            app.topic,
            key=b"acc-0",
            value=b"{}",
            partition=0,
            headers=[("id", str(event_id))],
            on_delivery=lambda _e, m: placed.append((m.partition() or 0, m.offset() or 0)),
        )
    assert producer.flush(30) == 0
    assert [offset for _, offset in placed] == list(range(12_000))
    chosen = [0, 1, 11_998, 11_999]
    with engine.begin() as conn:
        for n in chosen:
            conn.execute(
                sa.insert(outbox).values(
                    **_row(app, "acc-0", id=ids[n], event_key=str(ids[n])),
                    status="published",
                    published_at=sa.text("now()"),
                    kafka_partition=0,
                    kafka_offset=n,
                )
            )

    report = verify_window(
        engine,
        kafka_config={"bootstrap.servers": kafka_bootstrap},
        effects=[],
        since=since,
        timeout=15,
    )

    assert (report.checked, report.lost, report.outbox.published) == (4, 0, 4)
    assert _CountingConsumer.received < 5000, "the consumer sought over the gap"
