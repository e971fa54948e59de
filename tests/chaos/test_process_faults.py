"""S2, S4, S10, S11 at small scale (in `make test`); S1, S3 and S14 under load (`make chaos`).

Each scenario breaks real processes against the real broker and database, then the ledger
checker (tests/chaos/ledger.py) proves: 0 lost, 0 duplicate effects, per-key order kept (the
effects of a key applied in ``seq`` order: one writer per key, so that is commit order, and
receipts keep only each event's first copy, so it is the order of first occurrences).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.producer.staging import stage
from oncely.schemas.codec import Codec
from tests.chaos.harness import Pipeline, Proc
from tests.chaos.ledger import LedgerReport, check
from tests.helpers import read_topics, wait_until

#: The relay loop's failpoints, in the order a page meets them (oncely/failpoints.py).
RELAY_POINTS = [
    "relay.after_read",
    "relay.mid_page",
    "relay.after_produce_before_ack",
    "relay.after_ack_before_record",
    "relay.after_record_before_commit",
]
#: Exits after the broker acknowledged a page whose progress was never committed.
ACKED_NOT_RECORDED = ("relay.after_ack_before_record", "relay.after_record_before_commit")
#: The takeover after a SIGKILL with the default settings (6 s lease): ~10 s, with slack for
#: a busy shared machine.
TAKEOVER_LIMIT = 15.0
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
    committed = chaos.staged()
    chaos.wait_applied(committed)
    # The successor took the shards over (their leases expired) and recorded every row.
    wait_until(lambda: chaos.published() == committed, timeout=60)
    assert consumer.alive()
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert report.rolled_back > 0
    if point in ACKED_NOT_RECORDED:
        # The broker had the records, the progress was never recorded: they are sent again.
        assert report.kafka_duplicates > 0, report.summary()


@pytest.mark.parametrize("crash", CONSUMER_CRASHES)
def test_s4_a_consumer_exiting_at_each_failpoint_applies_once(chaos: Pipeline, crash: str) -> None:
    point, _, how = crash.partition(":")
    chaos.write(60, keys=6, rollback_every=7)
    chaos.relay().start()
    # Four effects of every event in one process, on per-key lanes, one per way of writing
    # (ctx.session, ctx.insert, a batch handler, an async handler): each effect must apply each
    # event once, in each key's order, across the crash.
    effects, lanes = ("ledger", "audit", "ledger.batch", "ledger.async"), "3"
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
    committed = chaos.staged()
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


def _wait_published(relay: Proc, timeout: float = 60) -> float:
    """Seconds until ``relay``'s /metrics counts a first acknowledged record."""
    started = time.monotonic()
    while relay.published() <= 0:
        assert relay.alive(), f"{relay.log.name} exited"
        assert time.monotonic() - started < timeout, f"{relay.log.name} published nothing"
        time.sleep(0.1)
    return time.monotonic() - started


@contextmanager
def _writing_under_load(chaos: Pipeline, *, pause: float) -> Iterator[None]:
    """One writer stages batches over 50 keys (one event of 11 rolled back in each), ``pause``
    seconds apart, for as long as the block runs."""
    stop = threading.Event()
    writer = chaos.write_until(stop, keys=50, rollback_every=11, pause=pause)
    try:
        yield
    finally:
        stop.set()
        writer.join(60)


def _drained(chaos: Pipeline) -> tuple[float, LedgerReport]:
    """Wait (up to 300 s) until every committed row is applied: the seconds it took and the
    ledger check then."""
    recovery = chaos.wait_applied(chaos.staged(), timeout=300)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    return recovery, report


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_s1_a_relay_killed_under_load_is_taken_over_quickly(chaos: Pipeline) -> None:
    """SIGKILL the relay under load, restart it: with the default settings its successor
    publishes again within ~10 s (the dead relay's 6 s shard leases must expire)."""
    chaos.consumer().start()
    takeovers: list[float] = []
    with _writing_under_load(chaos, pause=0):
        relay = chaos.relay("relay-0", metrics=True, defaults=True).start()
        _wait_published(relay)
        for kill in range(1, 5):
            time.sleep(3)  # it publishes under load, with pages in flight
            relay.kill(signal.SIGKILL)
            killed = time.monotonic()
            relay = chaos.relay(f"relay-{kill}", metrics=True, defaults=True).start()
            _wait_published(relay)
            takeovers.append(time.monotonic() - killed)
    recovery, report = _drained(chaos)
    print(
        f"S1 kills={len(takeovers)} takeover_after_sigkill="
        f"{'/'.join(f'{t:.1f}' for t in takeovers)}s (max {max(takeovers):.1f}s) "
        f"drain={recovery:.1f}s {chaos.peak_memory()} {report.summary()}"
    )
    assert report.ok, report.summary()
    assert max(takeovers) <= TAKEOVER_LIMIT, f"takeovers {takeovers} s"


def _zombie_shards(chaos: Pipeline) -> int:
    return chaos.count("SELECT count(*) FROM oncely_relay_shards WHERE owner = 'zombie'")


@pytest.mark.chaos
@pytest.mark.timeout(600)
@pytest.mark.parametrize("when", ["at-random", "before-recording", "inside-progress-transaction"])
def test_s3_a_zombie_relay_cannot_overwrite_the_new_owner(chaos: Pipeline, when: str) -> None:
    """SIGSTOP a relay holding shards under load, past its lease; a successor takes them over;
    SIGCONT: the zombie's progress is refused (or its leases found lost) and nothing is lost.

    ``at-random``: the test stops it from outside, with 2 s of linger keeping records unsent.
    ``before-recording``: it stops itself when a page is acknowledged and its progress not yet
    written (failpoint ``relay.after_ack_before_record=stop-after:N``), so it resumes by writing
    that progress: refused, counted in ``oncely_relay_progress_refused_total``.
    ``inside-progress-transaction``: it stops itself with its progress written and not committed
    (``relay.after_record_before_commit``), holding the shards' rows locked: the server ends
    that transaction (idle_in_transaction_session_timeout) so that the successor can take them.
    """
    chaos.consumer().start()
    env = {"ONCELY_RELAY_RELAY_ID": "zombie"}
    if when == "at-random":
        env["ONCELY_RELAY_LINGER_MS"] = "2000"
    elif when == "before-recording":
        env["ONCELY_FAILPOINTS"] = "relay.after_ack_before_record=stop-after:20"
    else:
        env["ONCELY_FAILPOINTS"] = "relay.after_record_before_commit=stop-after:20"
    zombie = chaos.relay("zombie", metrics=True).start(**env)
    # Under load from its first row: a relay that leased its shards only after a quick writer
    # was done would drain the backlog in a few recordings and never reach its failpoint.
    wait_until(lambda: _zombie_shards(chaos) > 0, timeout=60)
    writer = chaos.write_in_background(1000, keys=20)
    if when == "at-random":
        wait_until(lambda: zombie.published() > 0, timeout=60, interval=0.05)
        zombie.kill(signal.SIGSTOP)  # it holds leases and unsent records
    else:
        wait_until(zombie.stopped, timeout=60, interval=0.05)
    held = _zombie_shards(chaos)
    assert held > 0
    chaos.relay("successor").start(ONCELY_RELAY_RELAY_ID="successor")
    wait_until(lambda: _zombie_shards(chaos) == 0, timeout=60)  # past the zombie's lease
    zombie.kill(signal.SIGCONT)
    writer.join()
    chaos.wait_applied(chaos.staged(), timeout=300)

    def counted() -> tuple[float, float]:
        metrics = zombie.metrics()
        return (
            metrics["oncely_relay_progress_refused_total"],
            metrics["oncely_relay_lease_lost_total"],
        )

    def seen(refused: float, lost: float) -> bool:
        # before-recording: it resumes by writing the page's progress, which is refused;
        # at-random: by renewing its leases (found lost) or by writing progress (refused).
        return refused > 0 if when == "before-recording" else refused + lost > 0

    deadline = time.monotonic() + 30  # it may answer /metrics before its loop turns
    refused, lost = counted()
    while not seen(refused, lost) and time.monotonic() < deadline:
        time.sleep(0.1)
        refused, lost = counted()
    time.sleep(3)  # what the zombie had produced but not sent goes out once it resumed
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    print(
        f"S3 {when} zombie_shards={held} progress_refused={refused:.0f} lease_lost={lost:.0f} "
        f"{chaos.peak_memory()} {report.summary()}"
    )
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert seen(refused, lost), f"the zombie's progress was not refused\n{zombie.log.read_text()}"
    assert zombie.alive(), chaos.logs()


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_s14_three_relays_joining_and_leaving_under_load_share_the_shards(
    chaos: Pipeline,
) -> None:
    """Relays join one by one up to three, one leaves gracefully (SIGTERM), one dies (SIGKILL),
    others join: the shards are shared fairly after each change, and the ledger holds."""
    chaos.consumer().start()
    total = chaos.count("SELECT count(*) FROM oncely_relay_shards")
    relays: dict[str, Proc] = {}
    timings: list[str] = []

    def join(name: str) -> None:
        relays[name] = chaos.relay(name, metrics=True).start(ONCELY_RELAY_RELAY_ID=name)

    def shared(step: str) -> None:
        """Wait until the live relays hold every shard, each its fair share (one at most over
        another), and each publishes."""
        started = time.monotonic()
        names = sorted(n for n, r in relays.items() if r.alive())
        deadline = started + 60
        while True:
            owners = chaos.shard_owners()
            counts = [owners.get(n, 0) for n in names]
            if sorted(owners) == names and sum(counts) == total and max(counts) - min(counts) <= 1:
                break
            assert time.monotonic() < deadline, f"{step}: shards {owners}, relays {names}"
            time.sleep(0.1)
        timings.append(f"{step}={time.monotonic() - started:.1f}s")
        for name in names:
            wait_until(lambda n=name: relays[n].published() > 0, timeout=60)  # type: ignore[misc]

    with _writing_under_load(chaos, pause=0.05):
        for name in ("r0", "r1", "r2"):
            join(name)
            time.sleep(2)
            shared(f"join_{name}")
        time.sleep(3)
        relays["r0"].kill(signal.SIGTERM)  # leaves: its shards are handed off
        shared("leave_r0")
        join("r3")
        shared("join_r3")
        time.sleep(3)
        relays["r1"].kill(signal.SIGKILL)  # dies: its shards are taken when the leases expire
        shared("kill_r1")
        join("r4")
        shared("join_r4")
        time.sleep(3)
    recovery, report = _drained(chaos)
    print(f"S14 {' '.join(timings)} drain={recovery:.1f}s {chaos.peak_memory()} {report.summary()}")
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
