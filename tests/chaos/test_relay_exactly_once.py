"""Exactly-once mode (``--exactly-once``) as processes on the real broker and database: a relay
killed mid-drain, killed after a Kafka commit and before its progress is recorded, or paused
past its lease while another takes its shards and then resumed, puts no duplicate record before
a ``read_committed`` consumer reading from the beginning; nothing is lost and each key's records
keep their order. The SIGKILL scenario runs at least once too, for the count to compare.

Under load (``make chaos``): a broker of three killed and restarted mid-transaction, and two
relays rebalancing the shards while rows are written."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from oncely.devstack import KafkaCluster
from oncely.devstack._process import free_port
from oncely.wire import progress_topic
from tests.helpers import (
    count_published,
    insert_rows,
    oncely_process,
    outbox_rows,
    scalar,
    start_oncely,
    wait_ready,
    wait_until,
)
from tests.helpers.kafka import Record, read_committed

ROWS = 20_000


def _relay(
    database_url: str,
    bootstrap: str,
    prefix: str,
    name: str,
    *,
    exactly_once: bool,
    lease: float = 2,
    **env: str,
) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", prefix=f"relay-{name}-", delete=False) as log:
        process = start_oncely(
            *("relay", "run", "--database-url", database_url, "--bootstrap-servers", bootstrap),
            *("--relay-id", name, "--metrics-port", str(port), "--lease-seconds", str(lease)),
            *(["--exactly-once"] if exactly_once else []),
            env={
                "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2",
                "ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX": prefix,
                **env,
            },
            without=["ONCELY_RELAY_"],
            # A file, not a pipe: a relay meeting a broker outage logs more than a pipe holds
            # before the test reads it, and would block on writing.
            stderr=log,
        )
    _LOGS[process.pid] = Path(log.name)
    return process, port


#: Each relay's log file, by process id.
_LOGS: dict[int, Path] = {}


def _stop(process: subprocess.Popen[str]) -> str:
    """Stop the relay (resumed first if paused); its log, also written to stderr."""
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log = _LOGS.pop(process.pid)
    text = log.read_text(errors="replace")
    log.unlink()
    print(f"--- relay {process.pid}'s log\n{text}", file=sys.stderr)  # shown if the test fails
    return text


def _killed_at(
    point: str, database_url: str, bootstrap: str, prefix: str, *, exactly_once: bool = True
) -> tuple[subprocess.Popen[str], int]:
    """A relay run until it exits at the failpoint ``point`` (as abruptly as SIGKILL), then
    the relay that follows it (started, not yet ready) and its metrics port."""
    victim, _ = _relay(
        database_url,
        bootstrap,
        prefix,
        "victim",
        exactly_once=exactly_once,
        ONCELY_FAILPOINTS=f"{point}=exit",
    )
    victim.wait(timeout=60)
    _stop(victim)
    assert victim.returncode == 137
    return _relay(database_url, bootstrap, prefix, "survivor", exactly_once=exactly_once)


def _check(records: list[Record], rows: list[dict[str, object]]) -> int:
    """Nothing lost and each key's records in staged order (after their first copy); the
    number of duplicates."""
    seen = Counter(r.headers["id"].decode() for r in records)
    assert set(seen) == {str(row["id"]) for row in rows}, "records lost"
    firsts: dict[str, list[int]] = defaultdict(list)
    copies: set[str] = set()
    for record in records:
        event_id = record.headers["id"].decode()
        if event_id not in copies:
            copies.add(event_id)
            firsts[record.key].append(int(record.headers["n"]))
    for key, order in firsts.items():
        assert order == sorted(order), f"key {key} out of order"
    return sum(seen.values()) - len(seen)


@pytest.fixture
def staged(engine: sa.Engine, new_topic: Callable[..., str]) -> tuple[str, list[dict[str, object]]]:
    """A topic of three partitions, and 3,000 rows over 100 keys staged for it."""
    topic = new_topic(partitions=3)
    rows = outbox_rows(3000, topics=[topic], keys=100)
    insert_rows(engine, rows)
    return topic, rows


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_a_relay_killed_mid_drain_then_replaced_puts_no_duplicate_on_the_wire(
    exactly_once: bool,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    progress_prefix: str,
) -> None:
    topic = new_topic(partitions=3)
    rows = outbox_rows(ROWS, topics=[topic], keys=200)
    insert_rows(engine, rows)
    victim, port = _relay(
        database_url, kafka_bootstrap, progress_prefix, "victim", exactly_once=exactly_once
    )
    try:
        wait_ready(port, victim)
        wait_until(lambda: count_published(engine) >= ROWS // 5, timeout=60, interval=0.02)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        _stop(victim)
    assert count_published(engine) < ROWS, "drained before the kill: nothing tested"
    survivor, port = _relay(
        database_url, kafka_bootstrap, progress_prefix, "survivor", exactly_once=exactly_once
    )
    try:
        wait_ready(port, survivor)
        wait_until(lambda: count_published(engine) == ROWS, timeout=120)
    finally:
        _stop(survivor)
    duplicates = _check(read_committed(kafka_bootstrap, [topic]), rows)
    print(f"{'exactly' if exactly_once else 'at least'} once: {duplicates} duplicate records")
    if exactly_once:
        assert duplicates == 0


def test_a_relay_killed_after_a_kafka_commit_before_recording_it_is_followed_from_kafka(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    staged: tuple[str, list[dict[str, object]]],
    progress_prefix: str,
) -> None:
    topic, rows = staged
    survivor, port = _killed_at(
        "relay.after_ack_before_record", database_url, kafka_bootstrap, progress_prefix
    )
    try:
        wait_ready(port, survivor)
        wait_until(lambda: count_published(engine) == len(rows), timeout=60)
    finally:
        stderr = _stop(survivor)
    assert "from where Kafka has them" in stderr  # a commit ahead of the recorded progress
    assert _check(read_committed(kafka_bootstrap, [topic]), rows) == 0


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_a_relay_killed_after_releasing_a_key_before_unparking_it_publishes_its_rows_once(
    exactly_once: bool,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    progress_prefix: str,
) -> None:
    """A delayed row parks its key and holds the key's 29 later rows; once it is due, the relay
    publishes the 30 (exactly once, in one transaction) and exits before PostgreSQL records the
    key unparked. Exactly once, the next relay unparks the key from the release its progress
    record names and publishes none of them again; at least once, it publishes them again."""
    topic = new_topic(partitions=3)
    rows = outbox_rows(300, topics=[topic], keys=10)
    rows[0]["available_at"] = datetime.now(UTC) + timedelta(seconds=4)
    insert_rows(engine, rows[:1])
    insert_rows(engine, rows[1:])
    survivor, port = _killed_at(
        "relay.after_release_before_unpark",
        database_url,
        kafka_bootstrap,
        progress_prefix,
        exactly_once=exactly_once,
    )
    parked = "SELECT count(*) FROM oncely_relay_parked"
    try:
        wait_ready(port, survivor)
        wait_until(lambda: scalar(engine, parked) == 0, timeout=60)
        wait_until(lambda: count_published(engine) == len(rows), timeout=60)
    finally:
        _stop(survivor)
    duplicates = _check(read_committed(kafka_bootstrap, [topic]), rows)
    if exactly_once:
        assert duplicates == 0
    else:
        assert duplicates >= 30, "the key's rows published again: the count to compare"


def test_a_paused_relay_whose_shards_were_taken_is_fenced_and_publishes_nothing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    staged: tuple[str, list[dict[str, object]]],
    progress_prefix: str,
) -> None:
    topic, rows = staged
    zombie, _ = _relay(
        database_url,
        kafka_bootstrap,
        progress_prefix,
        "zombie",
        exactly_once=True,
        # Its transactions time out after 8 s (the lease), and the broker ends those timed out
        # every 10 s: resumed about 8 s after the pause, only the fencing keeps it out.
        lease=8,
        # Paused with a page's records on the broker, about to commit its transaction (the
        # 20th: the first ones may still wait for the transaction coordinator).
        ONCELY_FAILPOINTS="relay.before_commit=stop-after:20",
    )
    try:
        wait_until(lambda: zombie.poll() is None and _stopped(zombie), timeout=30)
        taker, port = _relay(
            database_url, kafka_bootstrap, progress_prefix, "taker", exactly_once=True
        )
        try:
            wait_ready(port, taker)
            # Resumed once the taker has published every row (its read-back of the progress
            # done): only the fencing keeps the zombie's paused commit from making copies.
            wait_until(lambda: count_published(engine) == len(rows), timeout=60, interval=0.05)
            zombie.send_signal(signal.SIGCONT)
            time.sleep(3)  # its commit fails at once; any later try of the zombie's would show
        finally:
            _stop(taker)
    finally:
        stderr = _stop(zombie)
    assert _check(read_committed(kafka_bootstrap, [topic]), rows) == 0
    assert "cannot go on" in stderr or "published by another relay" in stderr  # it gave up


def _owners(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text("SELECT DISTINCT owner FROM oncely_relay_shards WHERE lease_until > now()")
            ).scalars()
        )


def _stopped(process: subprocess.Popen[str]) -> bool:
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[-1].split()[0] == "T"


def test_topics_ensure_creates_the_compacted_progress_topic_the_relay_needs(
    database_url: str, kafka_bootstrap: str, kafka_admin: AdminClient
) -> None:
    prefix = f"test-{uuid.uuid4().hex}"
    relay = oncely_process(
        *("relay", "run", "--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
        "--exactly-once",
        env={"ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX": prefix},
        timeout=60,
    )
    assert relay.returncode == 2
    assert f"{prefix}.progress, which is missing" in relay.stderr
    assert "oncely topics ensure --exactly-once" in relay.stderr

    ensure = oncely_process(
        *("topics", "ensure", "--registry", "tests.apps.ledger:registry"),
        *("--bootstrap-servers", kafka_bootstrap, "--exactly-once"),
        env={"ONCELY_RELAY_TRANSACTIONAL_ID_PREFIX": prefix},
        timeout=60,
    )
    assert ensure.returncode == 0, ensure.stderr
    assert f"created   {prefix}.progress (1 partitions" in ensure.stdout
    assert "cleanup.policy compact" in ensure.stdout
    resource = ConfigResource(ResourceType.TOPIC, f"{prefix}.progress")
    configs = kafka_admin.describe_configs([resource])[resource].result(30)
    assert configs["cleanup.policy"].value == "compact"
    kafka_admin.delete_topics([f"{prefix}.progress"])[f"{prefix}.progress"].result(30)


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_broker_killed_mid_transaction_and_restarted_costs_no_duplicate(
    engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    """On three brokers replicating everything (factor 3, two in sync), the leader of the
    progress topic is killed mid-drain and restarted: a transaction coordinator, and the leader
    of transactions' partitions, lost with transactions open and commits under way.

    Not on one broker: Kafka 4.4.0's only broker, restarted, can skip the commit markers of a
    transaction it was committing and leave it hanging (KAFKA-20734;
    docs/how-to/deploy.md#a-hanging-transaction), which no client can end."""
    with KafkaCluster(data_dir=tmp_path / "kafka", size=3, heap="384m") as cluster:
        bootstrap = cluster.bootstrap_servers
        prefix = f"test-{uuid.uuid4().hex}"
        topic = f"{prefix}.events"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        compacted = {"cleanup.policy": "compact"}
        specs = [
            NewTopic(topic, num_partitions=3),
            NewTopic(progress_topic(prefix), num_partitions=1, config=compacted),
        ]
        for future in admin.create_topics(specs).values():
            future.result(30)
        rows = outbox_rows(ROWS, topics=[topic], keys=200)
        insert_rows(engine, rows)
        relay, port = _relay(database_url, bootstrap, prefix, "relay", exactly_once=True)
        try:
            wait_ready(port, relay)
            wait_until(lambda: count_published(engine) >= ROWS // 5, timeout=60, interval=0.02)
            [(victim, _)] = cluster.partition_leaders(progress_topic(prefix)).most_common(1)
            cluster.kill(victim)  # transactions open, commits under way
            time.sleep(3)
            cluster.restart(victim)
            wait_until(lambda: count_published(engine) == ROWS, timeout=180)
            assert relay.poll() is None, "the relay gave up"
        finally:
            log = _stop(relay)
        assert "cannot go on" in log, "the kill met transactions under way"
        assert _check(read_committed(bootstrap, [topic]), rows) == 0


@pytest.mark.chaos
def test_two_relays_rebalancing_shards_under_load_put_no_duplicate_on_the_wire(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    progress_prefix: str,
) -> None:
    topic = new_topic(partitions=3)
    rows = outbox_rows(ROWS, topics=[topic], keys=200)
    chunks = [rows[start : start + 500] for start in range(0, ROWS, 500)]

    def write() -> None:
        for chunk in chunks:
            insert_rows(engine, chunk)
            time.sleep(0.25)

    writer = threading.Thread(target=write)
    relays: dict[str, subprocess.Popen[str]] = {}

    def start(name: str) -> None:
        relays[name], port = _relay(
            database_url, kafka_bootstrap, progress_prefix, name, exactly_once=True
        )
        wait_ready(port, relays[name])

    writer.start()
    try:
        start("a")
        time.sleep(2)
        start("b")  # a hands half its shards to b
        wait_until(lambda: _owners(engine) == {"a", "b"}, timeout=30)
        _stop(relays.pop("a"))  # b takes them all
        wait_until(lambda: _owners(engine) == {"b"}, timeout=30)
        start("c")  # b hands half to c
        wait_until(lambda: _owners(engine) == {"b", "c"}, timeout=30)
        relays["b"].send_signal(signal.SIGKILL)  # c takes b's once their leases end
        _stop(relays.pop("b"))
        writer.join()
        wait_until(lambda: count_published(engine) == ROWS, timeout=120)
    finally:
        writer.join()
        for process in relays.values():
            _stop(process)
    assert _check(read_committed(kafka_bootstrap, [topic]), rows) == 0
