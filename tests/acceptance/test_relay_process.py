"""`oncely relay run` as a process: metrics and health, SIGTERM hand-off, takeover after
SIGKILL with the default settings, a paused relay's late progress refused, and only JSON lines
on stderr while its broker is down."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from oncely.devstack._process import free_port
from tests.helpers import (
    count_published,
    fast_settings,
    http_get,
    insert_rows,
    metric,
    oncely_process,
    outbox_rows,
    publish_all,
    query_all,
    read_topics,
    running_relay,
    scalar,
    start_oncely,
    wait_ready,
    wait_until,
)

pytestmark = pytest.mark.acceptance


def _start_relay(
    database_url: str,
    bootstrap: str,
    *args: str,
    env: dict[str, str] | None = None,
    defaults: bool = False,
) -> subprocess.Popen[str]:
    """``oncely relay run`` in a subprocess; ``defaults``: every setting at its default."""
    quick = {} if defaults else {"ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2"}
    return start_oncely(
        *("relay", "run", "--database-url", database_url, "--bootstrap-servers", bootstrap),
        *args,
        env={**quick, **(env or {})},
        without=["ONCELY_RELAY_"],
    )


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    return proc.returncode, stderr


def _shards(engine: sa.Engine) -> dict[str | None, int]:
    """How many shards each relay holds under a live lease (``None``: free or expired)."""
    rows = query_all(
        engine,
        "SELECT CASE WHEN lease_until > now() THEN owner END AS owner, count(*) AS n"
        " FROM oncely_relay_shards GROUP BY 1",
    )
    return {row.owner: int(row.n) for row in rows}


def _members(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT relay_id FROM oncely_relay_members")).scalars())


def test_metrics_and_health_are_served_and_counters_move(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    port = free_port()
    insert_rows(engine, outbox_rows(10, topics=[topic], keys=5))  # a backlog before it starts
    proc = _start_relay(database_url, kafka_bootstrap, "--metrics-port", str(port))
    try:
        wait_ready(port, proc)
        assert http_get(port, "/healthz")[0] == 200
        wait_until(lambda: metric(port, "oncely_relay_published_total") == 10, timeout=30)
        insert_rows(engine, outbox_rows(50, topics=[topic], keys=5))
        wait_until(lambda: metric(port, "oncely_relay_published_total") == 60, timeout=30)
        pages = metric(port, "oncely_relay_publish_latency_seconds_count")
        assert 2 <= pages <= 60, "the latency is observed once per page"
        assert metric(port, "oncely_relay_shards") == 32
        assert metric(port, "oncely_relay_progress_refused_total") == 0
        wait_until(lambda: count_published(engine) == 60, timeout=15)
        # The backlog gauges are refreshed every few seconds: every shard drains to 0.
        wait_until(lambda: metric(port, "oncely_outbox_unpublished_rows{") == 0, timeout=15)
        _, text = http_get(port, "/metrics")
        assert text.count("oncely_outbox_unpublished_rows{shard=") == 32
    finally:
        code, stderr = _stop(proc)
    assert code == 0, stderr
    assert '"message": "relay started"' in stderr, "structured JSON logs"


def test_sigterm_under_load_exits_0_and_gives_every_shard_back(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    insert_rows(engine, outbox_rows(20_000, topics=[topic], keys=2000))
    # Slowed (small pages, few records in flight, long linger) so that it is stopped mid-run:
    # at full speed it drains 20,000 rows in well under a second.
    slow = {
        "ONCELY_RELAY_BATCH_SIZE": "100",
        "ONCELY_RELAY_MAX_IN_FLIGHT": "200",
        "ONCELY_RELAY_LINGER_MS": "50",
    }
    proc = _start_relay(database_url, kafka_bootstrap, "--relay-id", "doomed", env=slow)
    wait_until(lambda: count_published(engine) > 1000, timeout=60)
    started = time.monotonic()
    code, stderr = _stop(proc)
    assert code == 0, stderr
    assert time.monotonic() - started < 35
    # Every shard is free at once (no lease to wait out) and the relay left the members.
    assert _shards(engine) == {None: 32}
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_shards WHERE owner IS NOT NULL") == 0
    assert "doomed" not in _members(engine)
    assert count_published(engine) < 20_000, "it was stopped mid-run"
    # What it produced was recorded before it let go: the next relay publishes the rest only.
    publish_all(engine, kafka_bootstrap, 20_000, timeout=120)
    records = read_topics(kafka_bootstrap, [topic], timeout=60)
    assert len({r.headers["id"] for r in records}) == 20_000
    assert len(records) == 20_000, "the drained relay left produced rows unrecorded"


def test_another_relay_takes_over_within_10_s_of_a_sigkill_with_default_settings(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    ports = free_port(), free_port()
    victim = _start_relay(
        database_url,
        kafka_bootstrap,
        "--relay-id",
        "victim",
        "--metrics-port",
        str(ports[0]),
        defaults=True,
    )
    survivor = _start_relay(
        database_url,
        kafka_bootstrap,
        "--relay-id",
        "survivor",
        "--metrics-port",
        str(ports[1]),
        defaults=True,
    )
    try:
        wait_ready(ports[0], victim)
        wait_ready(ports[1], survivor)
        wait_until(lambda: _shards(engine) == {"victim": 16, "survivor": 16}, timeout=30)
        insert_rows(engine, outbox_rows(500, topics=[topic], keys=100))
        wait_until(lambda: count_published(engine) == 500, timeout=30)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.communicate(timeout=10)
        insert_rows(engine, outbox_rows(500, topics=[topic], keys=100))  # on every shard
        wait_until(lambda: count_published(engine) == 1000, timeout=30, interval=0.05)
        recovered = time.monotonic() - killed
        print(f"published again {recovered:.1f} s after the SIGKILL")
        assert _shards(engine) == {"survivor": 32}
    finally:
        _stop(survivor)
        _stop(victim)
    # The default lease is 6 s: the survivor takes the dead relay's shards as it expires.
    assert recovered < 10.0, f"publishing again took {recovered:.1f} s after the SIGKILL"
    assert len({r.headers["id"] for r in read_topics(kafka_bootstrap, [topic])}) == 1000


def test_a_paused_relay_cannot_record_progress_on_shards_another_relay_took_over(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A relay stalled between produce and ack (as if paused) past its lease loses its shards:
    the rows are published again by the new holder, and the stalled relay records nothing."""
    topic = new_topic()
    port = free_port()
    zombie = _start_relay(
        database_url,
        kafka_bootstrap,
        "--metrics-port",
        str(port),
        "--lease-seconds",
        "2",
        "--relay-id",
        "zombie",
        env={"ONCELY_FAILPOINTS": "relay.after_produce_before_ack=sleep:8"},
    )
    try:
        wait_ready(port, zombie)
        wait_until(lambda: _shards(engine) == {"zombie": 32}, timeout=10)
        epochs = scalar(engine, "SELECT sum(epoch) FROM oncely_relay_shards")
        insert_rows(engine, outbox_rows(20, topics=[topic], keys=20))
        # The zombie produced the rows (they reach the topic) and stalls before recording.
        wait_until(lambda: len(read_topics(kafka_bootstrap, [topic])) == 20, timeout=15)
        assert count_published(engine) == 0
        wait_until(lambda: _shards(engine).get("zombie", 0) == 0, timeout=10)  # lease expired
        with running_relay(engine, kafka_bootstrap, fast_settings(owner_id="owner")):
            wait_until(lambda: count_published(engine) == 20, timeout=30)
            # The takeover bumped every shard's epoch: the zombie's writes are fenced.
            assert scalar(engine, "SELECT sum(epoch) FROM oncely_relay_shards") == epochs + 32
            assert _shards(engine) == {"owner": 32}
            wait_until(lambda: metric(port, "oncely_relay_lease_lost_total") == 32, timeout=30)
        # Its copies reached the broker (and may be counted as confirmed), but it recorded nothing.
    finally:
        code, stderr = _stop(zombie)
    assert code == 0, stderr
    # Duplicates on the wire (the zombie's copies first), each event recorded once.
    records = read_topics(kafka_bootstrap, [topic])
    assert len({r.headers["id"] for r in records}) == 20
    assert len(records) == 40
    assert count_published(engine) == 20


def test_topics_ensure_creates_missing_topics_and_flags_weaker_ones(kafka_bootstrap: str) -> None:
    prefix = f"ensure{uuid.uuid4().hex[:8]}."  # topics of this test only
    env = {"ONCELY_TEST_TOPIC_PREFIX": prefix}
    command = [
        *("topics", "ensure", "--registry", "tests.apps.ledger:registry"),
        *("--bootstrap-servers", kafka_bootstrap, "--partitions", "3"),
    ]

    def ensure(*args: str) -> subprocess.CompletedProcess[str]:
        return oncely_process(*command, *args, env=env, timeout=60)

    first = ensure()
    assert first.returncode == 0, first.stderr
    assert f"created   {prefix}account.credited" in first.stdout
    second = ensure()
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"ok        {prefix}account.credited" in second.stdout
    weaker = ensure("--partitions", "6")
    assert weaker.returncode == 1
    assert "3 partitions, 6 declared" in weaker.stdout


def test_a_relay_facing_a_dead_broker_writes_only_json_lines(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """librdkafka's connection failures, then the relay's own delivery timeouts (every 2 s
    here; 30 s by default) with a new producer each time: every line on stderr is JSON."""
    insert_rows(engine, outbox_rows(20, topics=[new_topic()], keys=5))  # records to fail on
    nobody = f"127.0.0.1:{free_port()}"
    proc = _start_relay(database_url, nobody, env={"ONCELY_RELAY_DELIVERY_TIMEOUT_MS": "2000"})
    time.sleep(10)  # several delivery timeouts, each followed by a new producer
    code, stderr = _stop(proc)
    assert code == 0, stderr
    lines = stderr.splitlines()
    records = [json.loads(line) for line in lines]  # a line that is not JSON fails here
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    librdkafka = [record for record in records if record["logger"] == "oncely.kafka"]
    assert librdkafka, "librdkafka's connection failures are logged"
    assert all(record["client"].startswith("rdkafka#producer") for record in librdkafka)
    assert any(nobody in record["message"] for record in librdkafka)
    assert {record["level"] for record in librdkafka} <= {"ERROR", "WARNING", "INFO"}
    relay = [r for r in records if r["logger"].startswith("oncely.relay")]
    assert any(r["level"] == "WARNING" for r in relay), "the relay's delivery timeouts are logged"


def test_a_relay_on_a_database_without_oncely_tables_says_so_once_and_goes_on_once_they_exist(
    new_database: Callable[..., str], kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Not ready, one line naming the fix (not a warning per call, every second), then, once
    `oncely db upgrade` made the tables, ready and publishing."""
    url = new_database(empty=True)
    port = free_port()
    proc = _start_relay(
        url,
        kafka_bootstrap,
        "--metrics-port",
        str(port),
        env={"ONCELY_RELAY_PURGE_INTERVAL_SECONDS": "0.5"},
    )
    try:
        time.sleep(5)  # a few leases, listens and purges
        assert proc.poll() is None
        assert http_get(port, "/healthz")[0] == 200
        assert http_get(port, "/readyz")[0] == 503
        upgrade = oncely_process("db", "upgrade", "--database-url", url)
        assert upgrade.returncode == 0, upgrade.stderr
        wait_ready(port, proc)
        engine = sa.create_engine(url)
        try:
            insert_rows(engine, outbox_rows(5, topics=[new_topic()], keys=5))
            wait_until(lambda: count_published(engine) == 5, timeout=30)
        finally:
            engine.dispose()
    finally:
        code, stderr = _stop(proc)
    assert code == 0, stderr
    messages = [json.loads(line)["message"] for line in stderr.splitlines()]
    said = [m for m in messages if "no oncely tables" in m]
    assert said == [
        "the database has no oncely tables: run `oncely db upgrade`; not ready until then"
    ], messages
    assert not [m for m in messages if "does not exist" in m], "no warning per call"
    assert "oncely's tables exist now: going on" in messages
