"""C1 (cluster): scale-out on a real three-node Kafka cluster, and a broker lost under load.

Two relays and three instances of one consumer group run against a KRaft cluster of three
combined broker+controller nodes; the event topic has 6 partitions, replication factor 3 and
``min.insync.replicas`` 2 (created by ``ensure_topics``, as ``oncely topics ensure`` does).
While events flow:

1. the broker leading the most partitions of the topic is SIGKILLed and stays down: leadership
   moves, and writes go on with two in-sync replicas once the controller has fenced it;
2. meanwhile a second broker hangs (SIGSTOP) for a few seconds: one node of three answers, so
   the controller quorum is lost as well and ``acks=all`` writes time out; then that broker
   shuts down cleanly: its controlled shutdown shrinks the ISRs to the one broker left, which
   refuses writes with ``NOT_ENOUGH_REPLICAS`` (counted in the brokers' logs; librdkafka
   retries them until ``message.timeout.ms`` and the relay sees ``_MSG_TIMED_OUT``) until it
   returns. Either way the shards replay from their recorded progress and nothing goes dead;
3. a consumer instance is replaced (a rebalance while partitions move);
4. the crashed broker restarts and catches up.

The ledger checker then proves 0 lost, 0 duplicate effects and per-key order; the printed line
reports events, Kafka duplicates, the NOT_ENOUGH_REPLICAS refusals, the longest gap between two
applied effects, the catch-up time once the second broker is back (every event committed
before then has its effect), the crashed broker's restart-to-in-sync time and the drain time
after the load ended.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from oncely.devstack import KafkaCluster
from oncely.settings import TopicSettings
from oncely.topics import ensure_topics, planned_topics
from tests.apps.ledger import build, create_tables
from tests.chaos.harness import Pipeline, Proc, pipeline, unique_prefix
from tests.chaos.ledger import check, published
from tests.helpers import read_topics, scalar

pytestmark = pytest.mark.chaos

PARTITIONS = 6


@dataclass
class Observed:
    """What a sampler saw during the faults: the backlog, dead rows, the relays' errors."""

    max_pending: int = 0
    max_dead: int = 0
    errors: Counter[str] = field(default_factory=Counter)


def _dead(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM oncely_relay_parked WHERE reason = 'dead'"))


def _produce_errors(relays: list[Proc]) -> Counter[str]:
    """``oncely_relay_produce_errors_total`` per error code, summed over the live relays."""
    errors: Counter[str] = Counter()
    for relay in relays:
        try:
            text = relay.metrics_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("oncely_relay_produce_errors_total{"):
                labels, _, value = line.rpartition(" ")
                code = labels.split('error="', 1)[1].split('"', 1)[0]
                errors[code] += int(float(value))
    return errors


def _sample(engine: sa.Engine, relays: list[Proc], stop: threading.Event, seen: Observed) -> None:
    while not stop.wait(0.5):
        with engine.connect() as conn:
            committed = int(conn.execute(sa.text("SELECT count(*) FROM chaos_outbox")).scalar())
        seen.max_pending = max(seen.max_pending, committed - published(engine))
        seen.max_dead = max(seen.max_dead, _dead(engine))
        for name, count in _produce_errors(relays).items():
            seen.errors[name] = max(seen.errors[name], count)


def _load(chaos: Pipeline, stop: threading.Event) -> None:
    """Business transactions at a steady pace until ``stop`` (60 events per 0.5 s at most)."""
    chunk = 0
    while not stop.is_set():
        chaos.write(30, keys=40, seed=chunk)
        chunk += 1
        stop.wait(0.25)


def _consumer(chaos: Pipeline, name: str) -> Proc:
    """A ledger consumer logging JSON, so that its assignment can be read back."""
    proc = Proc(
        ["consume", "tests.apps.ledger:effects", "--effect", "ledger"],
        chaos.env(),
        chaos.log_dir / f"{name}.log",
    )
    chaos.procs.append(proc)
    return proc.start()


def _owned(proc: Proc) -> set[str]:
    """The partitions a consumer holds now, replayed from its (incremental) assign/revoke/lost
    logs.

    (Not AdminClient.describe_consumer_groups: librdkafka can abort the whole process when a
    group call meets a moving coordinator, which this scenario causes on purpose.)
    """
    owned: set[str] = set()
    for line in proc.log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("message") == "partitions assigned":
            owned |= set(record["partitions"])
        elif record.get("message") == "partitions revoked" or str(
            record.get("message", "")
        ).startswith("partitions lost"):  # dropped by the group (session timed out)
            owned -= set(record.get("partitions", []))
    return owned


def _wait_spread(members: list[Proc], *, timeout: float = 60) -> None:
    """Wait until each member holds 2 of the 6 partitions, and all 6 are held."""
    deadline = time.monotonic() + timeout
    while True:
        owned = [_owned(m) for m in members]
        if sorted(map(len, owned)) == [2, 2, 2] and len(set().union(*owned)) == PARTITIONS:
            return
        assert time.monotonic() < deadline, f"partitions not spread: {owned}"
        time.sleep(0.5)


def _refusals(cluster: KafkaCluster, topic: str) -> int:
    """Produce requests the brokers refused with NOT_ENOUGH_REPLICAS for ``topic`` (their logs)."""
    needle = "NotEnoughReplicasException"
    return sum(
        1
        for i in cluster.node_ids
        for line in cluster.node(i).log_file.read_text(errors="replace").splitlines()
        if needle in line and f"{topic}-" in line
    )


def _now(engine: sa.Engine) -> object:
    return scalar(engine, "SELECT clock_timestamp()")


def _catch_up(engine: sa.Engine, moment: object) -> float:
    """Seconds from ``moment`` until every event committed before it had its effect."""
    seconds = scalar(
        engine,
        "SELECT EXTRACT(EPOCH FROM max(l.applied_at) - :t) FROM ledger l"
        " JOIN chaos_outbox o ON o.id = l.event_id WHERE o.created_at <= :t",
        t=moment,
    )
    return max(0.0, float(seconds or 0))


def _longest_gap(engine: sa.Engine) -> float:
    gap = scalar(
        engine,
        "SELECT coalesce(max(gap), 0) FROM (SELECT EXTRACT(EPOCH FROM applied_at"
        " - lag(applied_at) OVER (ORDER BY applied_at)) AS gap FROM ledger) gaps",
    )
    return float(gap)


def _broker_order(engine: sa.Engine, bootstrap: str, topic: str) -> list[str]:
    """Keys whose first copies on the broker are not in ``seq`` order (the ledger checker
    checks the order effects were applied in; this tells a relay's fault from a consumer's)."""
    with engine.connect() as conn:
        seqs = dict(conn.execute(sa.text("SELECT CAST(id AS text), seq FROM chaos_outbox")).all())
    by_key: dict[str, list[int]] = {}
    for record in sorted(read_topics(bootstrap, [topic]), key=lambda r: (r.partition, r.offset)):
        by_key.setdefault(record.key, []).append(seqs[record.headers["id"].decode()])
    broken = []
    for key, order in by_key.items():
        first = list(dict.fromkeys(order))
        if first != sorted(first):
            broken.append(f"{key}: {first}")
    return broken


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KafkaCluster]:
    running = KafkaCluster(data_dir=tmp_path / "kafka", size=3, heap="384m")
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.timeout(420)
def test_c1_a_broker_lost_under_load_on_a_three_node_cluster(
    cluster: KafkaCluster, database_url: str, tmp_path: Path
) -> None:
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    prefix = unique_prefix()
    app = build(prefix, group_prefix=prefix)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    settings = TopicSettings(partitions=PARTITIONS, replication_factor=3, min_insync_replicas=2)
    # The dead-letter topics too (replicated as declared), as `topics ensure --effects` does.
    report = ensure_topics(admin, planned_topics(app.registry, settings, effects=app.effects))
    dead_letters = sorted(effect.dlq_topic(app.topic) for effect in app.effects)
    assert report.created == [app.topic, *dead_letters] and not report.failed, report
    stop_load, stop_sampler = threading.Event(), threading.Event()
    seen = Observed()
    try:
        with pipeline(engine, database_url, cluster.bootstrap_servers, app, tmp_path) as chaos:
            relays = [chaos.relay(f"relay-{i}", metrics=True).start() for i in range(2)]
            members = [_consumer(chaos, f"ledger-{i}") for i in range(3)]
            _wait_spread(members)
            writer = threading.Thread(target=_load, args=(chaos, stop_load), daemon=True)
            sampler = threading.Thread(
                target=_sample, args=(engine, relays, stop_sampler, seen), daemon=True
            )
            writer.start()
            sampler.start()
            time.sleep(4)
            leaders = cluster.partition_leaders(app.topic)
            victim = leaders.most_common(1)[0][0]
            # 1. The busiest leader crashes. Every acks=all write waits until the controller fences
            # it (broker.session.timeout.ms, 9 s) and drops it from the ISRs; then two in-sync
            # replicas carry the load.
            cluster.kill(victim)
            time.sleep(12)
            second = next(i for i in cluster.node_ids if i != victim)
            cluster.pause(second)  # 2a. a hung second broker: no quorum, writes time out
            time.sleep(5)
            cluster.resume(second)
            time.sleep(3)
            # 2b. the second broker shuts down cleanly: its last act moves leadership away and
            # shrinks the ISR to the one broker left, which refuses acks=all writes with
            # NOT_ENOUGH_REPLICAS until the broker returns.
            stopping = time.monotonic()
            cluster.node(second).stop()
            stopped = time.monotonic() - stopping
            # Down until the broker left has refused writes (at least 2 s): a relay still in
            # its backoff after the hung broker's timeouts sends nothing for a while.
            down = time.monotonic()
            while time.monotonic() - down < 2 or (
                not _refusals(cluster, app.topic) and time.monotonic() - down < 30
            ):
                time.sleep(0.5)
            cluster.node(second).start()
            quorum_back = _now(engine)
            refusals = _refusals(cluster, app.topic)
            members.pop(0).kill(signal.SIGTERM)  # 3. a rebalance while partitions move
            members.append(_consumer(chaos, "ledger-3"))
            time.sleep(2)
            restarted = time.monotonic()
            cluster.restart(victim)  # 4. the crashed broker returns and catches up
            in_sync = cluster.wait_in_sync(app.topic, timeout=120)
            back = time.monotonic() - restarted
            time.sleep(2)
            stop_load.set()
            writer.join(60)
            started = time.monotonic()
            chaos.wait_applied(chaos.staged(), timeout=240)
            recovery = time.monotonic() - started
            _wait_spread(members)
            stop_sampler.set()
            sampler.join(10)
            ledger = check(
                engine, cluster.bootstrap_servers, topics=[app.topic], effects=["ledger"]
            )
            dead = _dead(engine)
            errors = ",".join(f"{name}x{n}" for name, n in seen.errors.most_common()) or "none"
            print(
                f"C1 events={ledger.committed} killed=node{victim} "
                f"(led {leaders[victim]}/{PARTITIONS}) paused_then_stopped=node{second} "
                f"(clean stop {stopped:.1f}s) broker_not_enough_replicas={refusals} "
                f"longest_gap={_longest_gap(engine):.1f}s "
                f"catch_up_after_second_back={_catch_up(engine, quorum_back):.1f}s "
                f"restart_to_in_sync={back:.1f}s (isr wait {in_sync:.1f}s) "
                f"drain_after_load={recovery:.1f}s "
                f"max_pending={seen.max_pending} dead={max(dead, seen.max_dead)} "
                f"delivery_errors={errors} {ledger.summary()}"
            )
            broker_order = _broker_order(engine, cluster.bootstrap_servers, app.topic)
            print(
                f"C1 order_violations={ledger.order_violations} "
                f"broker_first_copies_out_of_order={broker_order}"
            )
            assert dead == 0 and seen.max_dead == 0, chaos.logs()
            assert refusals > 0, "the ISR never fell below min.insync.replicas"
            assert ledger.ok, f"{ledger.summary()}\n{chaos.logs()}"
            assert ledger.committed > 500, ledger.summary()
    finally:
        stop_load.set()
        stop_sampler.set()
        engine.dispose()


def test_dev_up_with_three_brokers_reports_nodes_and_controller(tmp_path: Path) -> None:
    """`oncely dev up --brokers 3` in a subprocess, as a developer runs it; then status, down."""
    oncely = [sys.executable, "-m", "oncely", "dev"]
    directory = str(tmp_path / "stack")
    up = subprocess.Popen(
        [*oncely, "up", "--brokers", "3", "--dir", directory],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        exports = dict(
            up.stdout.readline().removeprefix("export ").strip().split("=", 1) for _ in range(2)
        )
        bootstrap = exports["ONCELY_KAFKA_BOOTSTRAP_SERVERS"]
        assert len(bootstrap.split(",")) == 3, exports
        status = subprocess.run(
            [*oncely, "status", "--dir", directory], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert "3 nodes, active controller: node " in status.stdout, status.stdout
        assert status.stdout.count(", running, log ") == 3, status.stdout
        as_json = subprocess.run(
            [*oncely, "status", "--dir", directory, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        state = json.loads(as_json.stdout)
        assert state["kafka_controller"] in (1, 2, 3)
        assert [node["node_id"] for node in state["kafka_nodes"]] == [1, 2, 3]
        metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
        assert sorted(metadata.brokers) == [1, 2, 3]
    finally:
        down = subprocess.run(
            [*oncely, "down", "--dir", directory], capture_output=True, text=True, timeout=120
        )
        up.communicate(timeout=120)
    assert down.returncode == 0, down.stderr
    assert up.returncode == 0
