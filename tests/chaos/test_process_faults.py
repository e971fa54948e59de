"""S2, S4, S10, S11 at small scale (in `make test`); S1 and S3 under load (`make chaos`).

Each scenario breaks real processes against the real broker and database, then the ledger
checker (tests/chaos/ledger.py) proves: 0 lost, 0 duplicate effects, per-key order kept.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.producer.staging import stage
from oncely.schemas.codec import Codec
from tests.chaos.harness import Pipeline
from tests.chaos.ledger import check
from tests.helpers import read_topics, wait_until

RELAY_POINTS = [
    "relay.after_claim",
    "relay.after_produce_before_ack",
    "relay.after_ack_before_mark",
    "relay.after_mark_before_commit",
]
CONSUMER_CRASHES = [
    "consumer.after_poll",
    "consumer.after_effect_before_db_commit",
    "consumer.after_effect_before_db_commit:stall",
    "consumer.after_db_commit_before_offset_commit",
]


def _assert_ledger(chaos: Pipeline) -> None:
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    assert report.ok, f"{report.summary()}\n{report}\n{chaos.logs()}"


@pytest.mark.parametrize("point", RELAY_POINTS)
def test_s2_a_relay_exiting_at_each_failpoint_loses_nothing(chaos: Pipeline, point: str) -> None:
    chaos.write(60, keys=6, rollback_every=7)
    consumer = chaos.consumer().start()
    doomed = chaos.relay(f"relay-{point}").start(ONCELY_FAILPOINTS=f"{point}=exit")
    assert doomed.wait(60) == 137, chaos.logs()
    chaos.relay("relay-after").start()
    committed = chaos.count("SELECT count(*) FROM oncely_outbox")
    chaos.wait_applied(committed)
    assert consumer.alive()
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert report.rolled_back > 0
    if point == "relay.after_ack_before_mark":
        # The broker had the records, the rows were never marked: they are published again.
        assert report.kafka_duplicates > 0, report.summary()


@pytest.mark.parametrize("crash", CONSUMER_CRASHES)
def test_s4_a_consumer_exiting_at_each_failpoint_applies_once(chaos: Pipeline, crash: str) -> None:
    point, _, how = crash.partition(":")
    chaos.write(60, keys=6, rollback_every=7)
    chaos.relay().start()
    # Two effects of every event in one process, on per-key lanes: each effect must apply each
    # event once, in each key's order, across the crash.
    effects, lanes = ("ledger", "audit"), "3"
    if how == "stall":
        # Stalled inside its open transaction, then SIGKILLed: anything sent to the broker
        # before the commit (an offset) has had time to leave.
        doomed = chaos.consumer(*effects, name=f"doomed-{crash}").start(
            ONCELY_FAILPOINTS=f"{point}=sleep:60", ONCELY_CONSUMER_LANES=lanes
        )
        wait_until(lambda: "partitions assigned" in doomed.log.read_text(), timeout=60)
        time.sleep(3)
        doomed.kill(signal.SIGKILL)
    else:
        doomed = chaos.consumer(*effects, name=f"doomed-{crash}").start(
            ONCELY_FAILPOINTS=f"{point}=exit", ONCELY_CONSUMER_LANES=lanes
        )
        assert doomed.wait(60) == 137, chaos.logs()
    chaos.consumer(*effects, name="after").start(ONCELY_CONSUMER_LANES=lanes)
    committed = chaos.count("SELECT count(*) FROM oncely_outbox")
    for effect in effects:
        chaos.wait_applied(committed, effect=effect)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=[*effects])
    assert report.ok, f"{report.summary()}\n{report}\n{chaos.logs()}"


def test_s10_out_of_order_commits_are_all_published_and_applied(chaos: Pipeline) -> None:
    chaos.relay().start()
    chaos.consumer().start()
    codec = Codec(registry=chaos.app.registry)
    start = threading.Barrier(10)  # the engine's pool holds 15 connections

    def writer(n: int) -> None:
        with Session(chaos.engine) as session, session.begin():
            event = chaos.app.model(account_id=f"solo-{n}", amount=n + 1, n=n)
            staged = stage(session, event, codec=codec)
            session.execute(
                sa.text("INSERT INTO chaos_business VALUES (:e, true)"), {"e": staged.id}
            )
            start.wait(30)
            time.sleep((9 - n) * 0.1)  # lower seq commits later

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    chaos.wait_applied(10)
    _assert_ledger(chaos)


def test_s11_a_poison_event_is_dead_lettered_and_the_rest_flows(chaos: Pipeline) -> None:
    codec = Codec(registry=chaos.app.registry)
    chaos.write(30, keys=3)
    with Session(chaos.engine) as session, session.begin():
        poison = stage(session, chaos.app.model(account_id="acc-0", amount=-5, n=999), codec=codec)
        session.execute(sa.text("INSERT INTO chaos_business VALUES (:e, true)"), {"e": poison.id})
    chaos.write(30, keys=3, seed=1)
    chaos.relay().start()
    chaos.consumer().start()
    chaos.wait_applied(60)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    assert report.missing_effects == [f"ledger:{poison.id}"], report.summary()
    assert not (report.lost or report.duplicate_effects or report.order_violations)
    [dead] = read_topics(chaos.bootstrap, [f"{chaos.app.topic}.ledger.dlq"])
    assert dead.headers["id"] == str(poison.id).encode()
    assert dead.headers["oncely.dlq.error.class"] == b"ValueError"


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_s1_a_relay_killed_every_few_seconds_under_load(chaos: Pipeline) -> None:
    chaos.consumer().start()
    writer = chaos.write_in_background(3000, keys=50, rollback_every=11)
    relay = chaos.relay().start()
    kills = 0
    while writer.is_alive():
        time.sleep(2.0)
        relay.kill(signal.SIGKILL)
        kills += 1
        relay = chaos.relay().start()
    committed = chaos.count("SELECT count(*) FROM oncely_outbox")
    recovery = chaos.wait_applied(committed, timeout=300)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    print(f"S1 kills={kills} recovery={recovery:.1f}s {chaos.peak_memory()} {report.summary()}")
    assert report.ok, report.summary()


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_s3_a_zombie_relay_cannot_overwrite_the_new_owner(chaos: Pipeline) -> None:
    chaos.consumer().start()
    zombie = chaos.relay("zombie").start(
        ONCELY_RELAY_LINGER_MS="2000", ONCELY_RELAY_RELAY_ID="zombie"
    )
    writer = chaos.write_in_background(1000, keys=20)
    leased = "SELECT count(*) FROM oncely_outbox WHERE lease_owner = 'zombie'"
    wait_until(lambda: chaos.count(leased) > 0, timeout=60, interval=0.05)
    zombie.kill(signal.SIGSTOP)  # it holds leases and unsent records
    held = chaos.count(leased)
    chaos.relay("successor").start(ONCELY_RELAY_RELAY_ID="successor")
    time.sleep(6)  # past the zombie's lease
    zombie.kill(signal.SIGCONT)
    writer.join()
    chaos.wait_applied(chaos.count("SELECT count(*) FROM oncely_outbox"), timeout=300)
    wait_until(lambda: "settle(s) refused" in zombie.log.read_text(), timeout=60)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    print(f"S3 zombie_held={held} {chaos.peak_memory()} {report.summary()}")
    assert report.ok, report.summary()
