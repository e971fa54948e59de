"""Receipts against the real broker and database: executed twice never means applied twice."""

from __future__ import annotations

import inspect
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer, TopicPartition

from oncely.consumers.effects import EffectContext, FailurePolicy
from oncely.consumers.lanes import lane_of
from oncely.consumers.offsets import committed_offsets
from oncely.consumers.runner import EffectConsumer
from oncely.schemas.codec import Codec
from tests.apps.ledger import App
from tests.helpers import publish_events, read_topics, running_consumers, scalar, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]


@pytest.fixture
def app(new_ledger: Callable[..., App]) -> App:
    """Not the shared ``app``: one partition, so that every record is in one order."""
    return new_ledger(1, ways=True)


def _sample(consumer: EffectConsumer, name: str, **labels: str) -> float:
    value = consumer.metrics.registry.get_sample_value(
        name, {"effect": consumer.effect.name, **labels}
    )
    return value or 0.0


def _credit(app: App, account: str, amount: int, n: int) -> Any:
    return app.model(account_id=account, amount=amount, n=n)


#: The ways a handler writes: ctx.session, ctx.insert, a batch handler, an async handler.
WAYS = ["", ".insert", ".batch", ".async"]


@pytest.mark.parametrize("spelling", ["same", "capitals"])
@pytest.mark.parametrize("way", WAYS)
def test_the_same_event_delivered_twice_is_applied_once(
    app: App, engine: sa.Engine, kafka_bootstrap: str, way: str, spelling: str
) -> None:
    """Two copies in one batch, the first's ``id`` header the same as the second's or in
    capitals; then one redelivered, its ``id`` in braces, after the first was applied and
    committed: the same event each time."""
    codec = Codec(registry=app.registry)
    event_id = uuid.uuid4()
    event = _credit(app, "acc-1", 10, 1)
    first_id = str(event_id).upper() if spelling == "capitals" else event_id
    publish_events(kafka_bootstrap, codec, [(first_id, event), (event_id, event)])
    effect = f"ledger{way}"
    with running_consumers(app.effects, [effect], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _sample(consumer, "oncely_consumer_consumed_total") == 2, timeout=60)
        wait_until(
            lambda: _sample(consumer, "oncely_consumer_duplicates_suppressed_total") == 1,
            timeout=30,
        )
        assert _sample(consumer, "oncely_consumer_applied_total") == 1
    publish_events(kafka_bootstrap, codec, [("{" + event_id.hex.upper() + "}", event)])
    with running_consumers(app.effects, [effect], engine, kafka_bootstrap) as [consumer]:
        wait_until(
            lambda: _sample(consumer, "oncely_consumer_duplicates_suppressed_total") == 1,
            timeout=60,
        )
        assert _sample(consumer, "oncely_consumer_applied_total") == 0
    assert scalar(engine, "SELECT count(*) FROM ledger WHERE effect = :e", e=effect) == 1
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = :e", e=effect) == 1


@pytest.mark.parametrize("way", WAYS)
def test_a_failing_effect_rolls_its_receipt_back_and_applies_once_when_fixed(
    app: App, engine: sa.Engine, kafka_bootstrap: str, way: str
) -> None:
    codec = Codec(registry=app.registry)
    publish_events(kafka_bootstrap, codec, [(uuid.uuid4(), _credit(app, "acc-new", 5, 1))])
    effect = f"notify{way}"
    with running_consumers(app.effects, [effect], engine, kafka_bootstrap) as [consumer]:
        wait_until(
            lambda: _sample(consumer, "oncely_consumer_handler_failures_total") >= 3, timeout=60
        )
        assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 0
        assert scalar(engine, "SELECT count(*) FROM notifications") == 0
        with engine.begin() as conn:  # fix the data
            conn.execute(sa.text("INSERT INTO accounts VALUES ('acc-new')"))
        wait_until(lambda: _sample(consumer, "oncely_consumer_applied_total") == 1, timeout=30)
    assert scalar(engine, "SELECT count(*) FROM notifications") == 1
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts WHERE effect = :e", e=effect) == 1


def test_two_effects_of_one_event_both_apply(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    codec = Codec(registry=app.registry)
    publish_events(kafka_bootstrap, codec, [(uuid.uuid4(), _credit(app, "acc-2", 7, 1))])
    with running_consumers(app.effects, ["ledger", "audit"], engine, kafka_bootstrap) as both:
        for consumer in both:
            wait_until(
                lambda c=consumer: _sample(c, "oncely_consumer_applied_total") == 1, timeout=60
            )
    assert scalar(engine, "SELECT count(DISTINCT effect) FROM ledger") == 2
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 2


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_poison_record_is_dead_lettered_while_later_records_flow(
    app: App, engine: sa.Engine, kafka_bootstrap: str, lanes: int
) -> None:
    codec = Codec(registry=app.registry)
    poison_id = uuid.uuid4()
    publish_events(
        kafka_bootstrap,
        codec,
        [
            (uuid.uuid4(), _credit(app, "acc-3", 1, 1)),
            (poison_id, _credit(app, "acc-3", -1, 2)),
            (uuid.uuid4(), _credit(app, "acc-3", 3, 3)),
        ],
    )
    garbage = Producer({"bootstrap.servers": kafka_bootstrap})
    garbage.produce(
        app.topic, key=b"acc-4", value=b"\x00garbage", headers=[("id", str(uuid.uuid4()))]
    )
    garbage.flush(10)
    publish_events(kafka_bootstrap, codec, [(uuid.uuid4(), _credit(app, "acc-4", 4, 4))])
    group = app.effects.group_id("ledger")
    with running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap, lanes=lanes) as [
        consumer
    ]:
        wait_until(lambda: _sample(consumer, "oncely_consumer_applied_total") == 3, timeout=60)
        assert (
            _sample(consumer, "oncely_consumer_dead_lettered_total", reason="handler_failed") == 1
        )
        assert _sample(consumer, "oncely_consumer_dead_lettered_total", reason="undecodable") == 1
    applied = _ledger(engine)
    if lanes == 1:
        assert [row[0] for row in applied] == [1, 3, 4], "later records applied, in order"
    else:  # keys in parallel: acc-3's order holds
        assert sorted(row[0] for row in applied) == [1, 3, 4]
        assert [row[0] for row in applied if row[0] != 4] == [1, 3]
    committed = committed_offsets(
        {"bootstrap.servers": kafka_bootstrap}, group, [TopicPartition(app.topic, 0)], 30
    )
    assert committed[(app.topic, 0)] == 5, "committed past both dead letters"
    dlq = read_topics(kafka_bootstrap, [f"{app.topic}.ledger.dlq"])
    by_reason = {r.headers["oncely.dlq.reason"].decode(): r for r in dlq}
    failed = by_reason["handler_failed"]
    assert failed.headers["id"] == str(poison_id).encode()
    assert failed.headers["oncely.dlq.error.class"] == b"ValueError"
    assert b"negative amount -1" in failed.headers["oncely.dlq.error.message"]
    assert failed.headers["oncely.dlq.attempts"] == b"3"
    assert failed.headers["oncely.dlq.original.topic"] == app.topic.encode()
    assert failed.headers["oncely.dlq.original.offset"] == b"1"
    assert failed.key == "acc-3"
    undecodable = by_reason["undecodable"]
    assert undecodable.value == b"\x00garbage"
    assert undecodable.headers["oncely.dlq.original.offset"] == b"3"


def _ledger(engine: sa.Engine) -> list[tuple[int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT n FROM ledger ORDER BY applied_at"))]


@pytest.mark.parametrize("lanes", [1, 4])
def test_the_block_policy_stops_the_partition(
    app: App, engine: sa.Engine, kafka_bootstrap: str, lanes: int
) -> None:
    codec = Codec(registry=app.registry)
    publish_events(
        kafka_bootstrap,
        codec,
        [
            (uuid.uuid4(), _credit(app, "acc-5", 1, 1)),
            (uuid.uuid4(), _credit(app, "acc-5", -1, 2)),
            (uuid.uuid4(), _credit(app, "acc-5", 3, 3)),
        ],
    )
    with running_consumers(app.effects, ["strict"], engine, kafka_bootstrap, lanes=lanes) as [
        consumer
    ]:
        wait_until(lambda: _sample(consumer, "oncely_consumer_blocked_partitions") == 1, timeout=60)
        time.sleep(1.0)
        assert _sample(consumer, "oncely_consumer_applied_total") == 1
    assert [row[0] for row in _ledger(engine)] == [1]


def test_an_effect_s_task_is_queued_once_however_often_the_event_arrives(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    codec = Codec(registry=app.registry)
    event_id = uuid.uuid4()
    event = _credit(app, "acc-6", 9, 1)
    publish_events(kafka_bootstrap, codec, [(event_id, event)] * 3)
    with running_consumers(app.effects, ["email"], engine, kafka_bootstrap) as [consumer]:
        wait_until(lambda: _sample(consumer, "oncely_consumer_consumed_total") == 3, timeout=60)
        wait_until(
            lambda: _sample(consumer, "oncely_consumer_duplicates_suppressed_total") == 2,
            timeout=30,
        )
    with engine.connect() as conn:
        tasks = conn.execute(sa.text("SELECT task_key, name, payload FROM oncely_tasks")).all()
    assert [tuple(t) for t in tasks] == [
        (f"email:{event_id}:email.send", "email.send", {"to": "acc-6", "amount": 9})
    ]


def _keys_on_distinct_lanes(lanes: int, count: int) -> list[str]:
    keys: dict[int, str] = {}
    for i in range(1000):
        key = f"acc-lane-{i}"
        keys.setdefault(lane_of(key.encode(), lanes), key)
    assert len(keys) >= count
    return list(keys.values())[:count]


def test_lanes_apply_keys_in_parallel_and_each_key_in_order(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    # The first events of two keys on different lanes meet at a barrier: with one lane (or lanes
    # run one after the other) the barrier breaks and the handler fails.
    meet = threading.Barrier(2, timeout=20)
    met: set[str] = set()

    def post(event: Any, ctx: EffectContext) -> None:
        if event.account_id in first_two and event.account_id not in met:
            meet.wait()
            met.add(event.account_id)
        ctx.session.execute(
            sa.text("INSERT INTO ledger (event_id, effect, account_id, n) VALUES (:e, :f, :a, :n)"),
            {"e": ctx.event_id, "f": ctx.effect, "a": event.account_id, "n": event.n},
        )

    app.effects.effect("lanes", on=[app.model])(post)
    keys = _keys_on_distinct_lanes(4, 4) + [f"acc-{i}" for i in range(8)]
    first_two = set(keys[:2])
    events = [(uuid.uuid4(), _credit(app, keys[i % len(keys)], 1, i)) for i in range(600)]
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    with running_consumers(app.effects, ["lanes"], engine, kafka_bootstrap, lanes=4) as [c]:
        wait_until(lambda: _sample(c, "oncely_consumer_applied_total") == 600, timeout=90)
        assert _sample(c, "oncely_consumer_handler_failures_total") == 0
    assert met == first_two
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT account_id, n FROM ledger WHERE effect = 'lanes' ORDER BY applied_at")
        ).all()
    assert len(rows) == 600 and len({n for _, n in rows}) == 600, "each event applied once"
    for key in keys:
        applied = [n for account, n in rows if account == key]
        assert applied == sorted(applied), f"{key} applied out of order"


def test_a_slow_lane_does_not_hold_back_the_others_nor_the_commit_past_it(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    # One key's event (offset 5) waits until every event of the other keys is applied: those
    # span many batches, so the other lanes must keep taking work while it waits. Meanwhile
    # the partition's committed offset stays at the slow record.
    slow, *others = _keys_on_distinct_lanes(4, 4)
    release = threading.Event()

    def post(event: Any, ctx: EffectContext) -> None:
        if event.account_id == slow and event.n == 5:
            assert release.wait(60), "the other lanes did not get past the slow record"
        ctx.session.execute(
            sa.text("INSERT INTO ledger (event_id, effect, account_id, n) VALUES (:e, :f, :a, :n)"),
            {"e": ctx.event_id, "f": ctx.effect, "a": event.account_id, "n": event.n},
        )

    app.effects.effect("slowlane", on=[app.model])(post)
    keys = [others[i % 3] for i in range(300)]
    keys[5] = keys[250] = slow  # the slow record and one later record of its key
    events = [(uuid.uuid4(), _credit(app, key, 1, n)) for n, key in enumerate(keys)]
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    group = app.effects.group_id("slowlane")
    partition = [TopicPartition(app.topic, 0)]
    fast = "SELECT count(*) FROM ledger WHERE effect = 'slowlane' AND account_id <> :k"
    with running_consumers(
        app.effects, ["slowlane"], engine, kafka_bootstrap, lanes=4, batch_size=20
    ) as [c]:
        try:
            wait_until(lambda: scalar(engine, fast, k=slow) == 298, timeout=60)
            time.sleep(1.0)  # a commit past the slow record would have had time to land
            committed = committed_offsets(
                {"bootstrap.servers": kafka_bootstrap}, group, partition, 30
            )
            assert committed[(app.topic, 0)] == 5, "the commit stops at the unfinished record"
            assert scalar(engine, "SELECT count(*) FROM ledger WHERE account_id = :k", k=slow) == 0
        finally:
            release.set()
        wait_until(lambda: _sample(c, "oncely_consumer_applied_total") == 300, timeout=60)
    rows = "SELECT n FROM ledger WHERE effect = 'slowlane' AND account_id = :k ORDER BY applied_at"
    with engine.connect() as conn:
        assert conn.execute(sa.text(rows), {"k": slow}).scalars().all() == [5, 250], "in order"
    committed = committed_offsets({"bootstrap.servers": kafka_bootstrap}, group, partition, 30)
    assert committed[(app.topic, 0)] == 300


def test_lanes_hand_partitions_over_in_a_rebalance_each_event_once_in_key_order(
    new_ledger: Callable[..., App], engine: sa.Engine, kafka_bootstrap: str
) -> None:
    # A second member joins while the first's lanes hold work of every partition, then leaves:
    # each revoke finishes what its lanes started, commits the finished prefix and lets go.
    app = new_ledger(4)

    def post(event: Any, ctx: EffectContext) -> None:
        time.sleep(0.02)
        ctx.session.execute(
            sa.text("INSERT INTO ledger (event_id, effect, account_id, n) VALUES (:e, :f, :a, :n)"),
            {"e": ctx.event_id, "f": ctx.effect, "a": event.account_id, "n": event.n},
        )

    app.effects.effect("handover", on=[app.model])(post)
    keys = [f"acc-{i}" for i in range(24)]
    events = [(uuid.uuid4(), _credit(app, keys[i % 24], 1, i)) for i in range(2000)]
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    applied = "SELECT count(*) FROM ledger WHERE effect = 'handover'"
    settings = {"lanes": 4, "batch_size": 50}
    with running_consumers(app.effects, ["handover"], engine, kafka_bootstrap, **settings) as [a]:
        wait_until(lambda: _sample(a, "oncely_consumer_applied_total") >= 200, timeout=60)
        with running_consumers(app.effects, ["handover"], engine, kafka_bootstrap, **settings) as [
            b
        ]:
            wait_until(lambda: _sample(b, "oncely_consumer_applied_total") >= 50, timeout=60)
        wait_until(lambda: scalar(engine, applied) == 2000, timeout=120)
    assert scalar(engine, "SELECT count(DISTINCT event_id) FROM ledger") == 2000, "each once"
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT account_id, n FROM ledger WHERE effect = 'handover' ORDER BY applied_at"
            )
        ).all()
    for key in keys:
        ns = [n for account, n in rows if account == key]
        assert ns == sorted(ns), f"{key} applied out of order"
    group = app.effects.group_id("handover")
    partitions = [TopicPartition(app.topic, p) for p in range(4)]
    committed = committed_offsets({"bootstrap.servers": kafka_bootstrap}, group, partitions, 30)
    assert sum(committed.values()) == 2000, "every partition committed to its end"


@pytest.mark.parametrize("way", WAYS)
def test_lanes_commit_only_below_the_lowest_unfinished_record(
    app: App, engine: sa.Engine, kafka_bootstrap: str, way: str
) -> None:
    keys = _keys_on_distinct_lanes(4, 4)
    missing = keys[0]  # no account yet: its notification violates the foreign key
    with engine.begin() as conn:
        for key in keys[1:]:
            conn.execute(sa.text("INSERT INTO accounts VALUES (:k)"), {"k": key})
    events = [(uuid.uuid4(), _credit(app, keys[1 + i % 3], 1, i)) for i in range(1, 41)]
    events.insert(10, (uuid.uuid4(), _credit(app, missing, 1, 0)))  # offset 10 fails
    publish_events(kafka_bootstrap, Codec(registry=app.registry), events)
    group = app.effects.group_id(f"notify{way}")
    partition = [TopicPartition(app.topic, 0)]
    with running_consumers(app.effects, [f"notify{way}"], engine, kafka_bootstrap, lanes=4) as [c]:
        wait_until(lambda: _sample(c, "oncely_consumer_handler_failures_total") >= 3, timeout=60)
        others = "SELECT count(*) FROM notifications WHERE account_id <> :k"
        # The other keys' lanes go past the failing record.
        wait_until(lambda: scalar(engine, others, k=missing) == 40, timeout=30)
        committed = committed_offsets({"bootstrap.servers": kafka_bootstrap}, group, partition, 30)
        assert committed[(app.topic, 0)] == 10, "the commit stops at the lowest unfinished record"
        with engine.begin() as conn:  # fix the data
            conn.execute(sa.text("INSERT INTO accounts VALUES (:k)"), {"k": missing})
        wait_until(lambda: _sample(c, "oncely_consumer_applied_total") == 41, timeout=60)
        assert _sample(c, "oncely_consumer_duplicates_suppressed_total") > 0
    assert scalar(engine, "SELECT count(DISTINCT event_id) FROM notifications") == 41
    assert scalar(engine, "SELECT count(*) FROM notifications") == 41
    committed = committed_offsets({"bootstrap.servers": kafka_bootstrap}, group, partition, 30)
    assert committed[(app.topic, 0)] == 41


def test_a_handler_returning_a_coroutine_fails_its_record_and_writes_no_receipt(
    app: App, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    # A sync `def` passes the declaration check; what it returns is an unawaited coroutine.
    returned: list[Any] = []

    async def post_later(event: Any, ctx: EffectContext) -> None:
        ctx.session.execute(
            sa.text("INSERT INTO ledger (event_id, effect, n) VALUES (:e, :f, :n)"),
            {"e": ctx.event_id, "f": ctx.effect, "n": event.n},
        )

    def post(event: Any, ctx: EffectContext) -> Any:
        returned.append(post_later(event, ctx))
        return returned[-1]

    quick = FailurePolicy(max_attempts=2, initial_backoff_seconds=0.1, max_backoff_seconds=0.1)
    app.effects.effect("coroutine", on=[app.model], failure=quick)(post)
    event_id = uuid.uuid4()
    publish_events(
        kafka_bootstrap, Codec(registry=app.registry), [(event_id, _credit(app, "acc-7", 1, 1))]
    )
    with running_consumers(app.effects, ["coroutine"], engine, kafka_bootstrap) as [consumer]:
        dead_lettered = lambda: _sample(  # noqa: E731
            consumer, "oncely_consumer_dead_lettered_total", reason="handler_failed"
        )
        applied = lambda: _sample(consumer, "oncely_consumer_applied_total")  # noqa: E731
        wait_until(lambda: dead_lettered() == 1 or applied() > 0, timeout=60)
        assert applied() == 0, "not counted as applied"
        assert dead_lettered() == 1
        assert _sample(consumer, "oncely_consumer_handler_failures_total") == 2
    assert scalar(engine, "SELECT count(*) FROM oncely_receipts") == 0, "no receipt written"
    assert scalar(engine, "SELECT count(*) FROM ledger") == 0
    assert len(returned) >= 2, "called once per attempt"
    assert all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in returned), (
        "each coroutine was closed unrun (no 'never awaited' warning)"
    )
    [dead] = read_topics(kafka_bootstrap, [f"{app.topic}.coroutine.dlq"])
    assert dead.headers["id"] == str(event_id).encode()
    assert dead.headers["oncely.dlq.error.class"] == b"EffectDeclarationError"
    message = dead.headers["oncely.dlq.error.message"].decode()
    assert "returned an awaitable (coroutine)" in message
    assert "post" in message and "declare it with `async def`" in message
