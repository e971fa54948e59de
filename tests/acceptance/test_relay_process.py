"""`oncely relay run` as a process: metrics and health, SIGTERM drain, a zombie's refused settle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from oncely.devstack._process import free_port
from tests.helpers import (
    count_published,
    fast_settings,
    insert_rows,
    outbox_rows,
    read_topics,
    running_relay,
    wait_until,
)

pytestmark = pytest.mark.acceptance


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


def _start_relay(
    database_url: str, bootstrap: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oncely",
            "relay",
            "run",
            "--database-url",
            database_url,
            "--bootstrap-servers",
            bootstrap,
            *args,
        ],
        env={**os.environ, "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def _metric(port: int, name: str) -> float:
    _, text = _get(port, "/metrics")
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    return sum(values)


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    def ready() -> bool:
        assert proc.poll() is None, (proc.stderr.read() if proc.stderr else b"").decode()
        try:
            return _get(port, "/readyz")[0] == 200
        except OSError:
            return False

    wait_until(ready, timeout=30)


def _stop(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    return proc.returncode, stderr.decode()


def test_metrics_and_health_are_served_and_counters_move(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    port = free_port()
    insert_rows(engine, outbox_rows(10, topics=[topic], keys=5))  # a backlog before it starts
    proc = _start_relay(database_url, kafka_bootstrap, "--metrics-port", str(port))
    try:
        _wait_ready(port, proc)
        assert _get(port, "/healthz")[0] == 200
        wait_until(lambda: _metric(port, "oncely_relay_published_total") == 10, timeout=30)
        insert_rows(engine, outbox_rows(50, topics=[topic], keys=5))
        wait_until(lambda: _metric(port, "oncely_relay_published_total") == 60, timeout=30)
        assert _metric(port, "oncely_relay_claimed_total") == 60
        assert _metric(port, "oncely_relay_publish_latency_seconds_count") == 60
        drained = f'oncely_outbox_backlog_rows{{topic="{topic}"}} 0.0'
        wait_until(lambda: drained in _get(port, "/metrics")[1], timeout=15)
    finally:
        code, stderr = _stop(proc)
    assert code == 0, stderr
    assert '"message": "relay started"' in stderr, "structured JSON logs"


def test_sigterm_under_load_exits_0_and_leaves_no_lease(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    insert_rows(engine, outbox_rows(20_000, topics=[topic], keys=2000))
    proc = _start_relay(database_url, kafka_bootstrap, "--relay-id", "doomed")
    wait_until(lambda: count_published(engine) > 1000, timeout=60)
    started = time.monotonic()
    code, stderr = _stop(proc)
    assert code == 0, stderr
    assert time.monotonic() - started < 35
    with engine.connect() as conn:
        leased = conn.execute(
            sa.text(
                "SELECT count(*) FROM oncely_outbox WHERE lease_owner = 'doomed'"
                " AND status = 'pending'"
            )
        ).scalar_one()
    assert leased == 0
    assert count_published(engine) < 20_000, "it was stopped mid-run"


def test_a_paused_relay_cannot_settle_rows_another_relay_took_over(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    port = free_port()
    # A long linger keeps the zombie's claimed rows in its producer while it is paused.
    zombie = _start_relay(
        database_url,
        kafka_bootstrap,
        "--metrics-port",
        str(port),
        "--lease-seconds",
        "2",
        env={"ONCELY_RELAY_LINGER_MS": "3000"},
    )
    try:
        _wait_ready(port, zombie)
        insert_rows(engine, outbox_rows(20, topics=[topic], keys=20))
        wait_until(
            lambda: count_status(engine, "pending") == 20 and _leased(engine) == 20, timeout=10
        )
        zombie.send_signal(signal.SIGSTOP)
        time.sleep(3)  # past the 2 s lease
        with running_relay(engine, kafka_bootstrap, fast_settings()):
            wait_until(lambda: count_published(engine) == 20, timeout=30)
        zombie.send_signal(signal.SIGCONT)
        wait_until(lambda: _metric(port, "oncely_relay_lease_lost_total") == 20, timeout=30)
        assert _metric(port, "oncely_relay_published_total") == 0
    finally:
        zombie.send_signal(signal.SIGCONT)
        code, stderr = _stop(zombie)
    assert code == 0, stderr
    # The zombie's late records are duplicates on the wire; the rows stay settled once.
    records = read_topics(kafka_bootstrap, [topic])
    assert len({r.headers["id"] for r in records}) == 20
    assert count_published(engine) == 20


def test_a_zombie_resuming_before_the_new_owner_settles_is_refused_by_the_fence(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # The new owner holds the rows unsettled when the zombie resumes: the rows are still
    # pending, so only the owner + attempt fence can refuse the zombie's settles.
    topic = new_topic()
    zombie_port, owner_port = free_port(), free_port()
    zombie = _start_relay(
        database_url,
        kafka_bootstrap,
        "--metrics-port",
        str(zombie_port),
        "--lease-seconds",
        "2",
        env={"ONCELY_RELAY_LINGER_MS": "3000", "ONCELY_RELAY_RELAY_ID": "zombie"},
    )
    owner = None
    try:
        _wait_ready(zombie_port, zombie)
        insert_rows(engine, outbox_rows(20, topics=[topic], keys=20))
        wait_until(lambda: _leased(engine, "zombie") == 20, timeout=10)
        zombie.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # past the 2 s lease
        owner = _start_relay(
            database_url,
            kafka_bootstrap,
            "--metrics-port",
            str(owner_port),
            "--lease-seconds",
            "60",
            env={
                "ONCELY_RELAY_RELAY_ID": "owner",
                "ONCELY_FAILPOINTS": "relay.after_produce_before_ack=sleep:10",
            },
        )
        wait_until(lambda: _leased(engine, "owner") == 20, timeout=30)
        zombie.send_signal(signal.SIGCONT)
        settled = ("oncely_relay_lease_lost_total", "oncely_relay_published_total")
        wait_until(lambda: sum(_metric(zombie_port, m) for m in settled) >= 20, timeout=30)
        assert [_metric(zombie_port, m) for m in settled] == [20, 0], "the zombie settled"
        wait_until(lambda: count_published(engine) == 20, timeout=60)
        assert [_metric(owner_port, m) for m in settled] == [0, 20], "the owner was refused"
    finally:
        zombie.send_signal(signal.SIGCONT)
        code, stderr = _stop(zombie)
        if owner is not None:
            _stop(owner)
    assert code == 0, stderr


def _leased(engine: sa.Engine, owner: str | None = None) -> int:
    with engine.connect() as conn:
        sql = "SELECT count(*) FROM oncely_outbox WHERE lease_owner IS NOT NULL"
        if owner is not None:
            sql += " AND lease_owner = :owner"
        return int(conn.execute(sa.text(sql), {"owner": owner}).scalar_one())


def test_topics_ensure_creates_missing_topics_and_flags_weaker_ones(kafka_bootstrap: str) -> None:
    prefix = f"ensure{uuid.uuid4().hex[:8]}."  # topics of this test only
    env = {**os.environ, "ONCELY_TEST_TOPIC_PREFIX": prefix}
    command = [
        sys.executable,
        "-m",
        "oncely",
        "topics",
        "ensure",
        "--registry",
        "tests.apps.ledger:registry",
        "--bootstrap-servers",
        kafka_bootstrap,
        "--partitions",
        "3",
    ]

    def ensure(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, env=env, timeout=60, check=False
        )

    first = ensure()
    assert first.returncode == 0, first.stderr
    assert f"created   {prefix}account.credited" in first.stdout
    second = ensure()
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"ok        {prefix}account.credited" in second.stdout
    weaker = ensure("--partitions", "6")
    assert weaker.returncode == 1
    assert "3 partitions, 6 declared" in weaker.stdout
