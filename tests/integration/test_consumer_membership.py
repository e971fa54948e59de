"""A consumer without partitions past ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS is not ready,
and one left out of its group rejoins: against a real broker (issue 17, item 7)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.consumers.replay import group_members
from oncely.consumers.runner import EffectConsumer
from oncely.devstack import KafkaNode
from oncely.runtime.http import HealthServer
from oncely.schemas.codec import Codec
from oncely.settings import KafkaSettings
from tests.apps.ledger import App, build
from tests.helpers import (
    CliResult,
    oncely_cli,
    publish_events,
    running_consumers,
    scalar,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]

SESSION_MS = 6000
BOUND = 10.0  # ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS of these tests


def _app(admin: Any, partitions: int) -> App:
    prefix = f"m{uuid.uuid4().hex[:10]}."
    app = build(prefix, group_prefix=prefix)
    admin.create_topics([NewTopic(app.topic, num_partitions=partitions)])[app.topic].result(30)
    return app


@contextlib.contextmanager
def _readyz(consumer: EffectConsumer) -> Iterator[str]:
    server = HealthServer(
        registry=consumer.metrics.registry,
        healthy=consumer.healthy,
        ready=consumer.ready,
        port=0,
        host="127.0.0.1",
    )
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}/readyz"
    finally:
        server.stop()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _rejoins(consumer: EffectConsumer) -> float:
    value = consumer.metrics.registry.get_sample_value(
        "oncely_consumer_rejoins_total", {"effect": consumer.effect.name}
    )
    return value or 0.0


def _credits(app: App, count: int, first: int = 0) -> list[tuple[uuid.UUID, Any]]:
    return [
        (uuid.uuid4(), app.model(account_id=f"acc-{i % 5}", amount=1, n=i))
        for i in range(first, first + count)
    ]


def test_a_member_beyond_the_partition_count_is_not_ready_past_the_bound(
    engine: sa.Engine, kafka_bootstrap: str, kafka_admin: Any
) -> None:
    app = _app(kafka_admin, partitions=1)
    bound = 15.0  # room for the spare to join within it on a loaded machine
    settings: dict[str, Any] = {
        "session_timeout_ms": SESSION_MS,
        "assignment_timeout_seconds": bound,
    }
    publish_events(kafka_bootstrap, Codec(registry=app.registry), _credits(app, 1))
    with contextlib.ExitStack() as first_member:
        [holder] = first_member.enter_context(
            running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap, **settings)
        )
        assert isinstance(holder, EffectConsumer)
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM ledger") == 1, timeout=60)
        started = time.monotonic()  # the spare holds nothing from its start
        with (
            running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap, **settings) as [
                spare
            ],
            _readyz(holder) as holder_url,
        ):
            assert isinstance(spare, EffectConsumer)
            with _readyz(spare) as spare_url:
                wait_until(lambda: _status(spare_url) == 200, timeout=bound)  # joined, empty
                wait_until(lambda: _status(spare_url) == 503, timeout=bound + 30)
                assert time.monotonic() - started >= bound
                assert _status(holder_url) == 200
                assert _rejoins(spare) == 0, "a member the group gave nothing is not recreated"
                first_member.close()  # the holder leaves: the spare takes the partition over
                wait_until(lambda: _status(spare_url) == 200, timeout=60)
                assert spare.membership.partitions == {(app.topic, 0)}


def test_a_consumer_out_of_its_group_past_the_bound_rejoins_and_applies(
    engine: sa.Engine, tmp_path: Path
) -> None:
    broker = KafkaNode(data_dir=tmp_path / "kafka")
    broker.start()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    try:
        app = _app(admin, partitions=2)
        codec = Codec(registry=app.registry)
        publish_events(broker.bootstrap_servers, codec, _credits(app, 20))
        with running_consumers(
            app.effects,
            ["ledger"],
            engine,
            broker.bootstrap_servers,
            session_timeout_ms=SESSION_MS,
            assignment_timeout_seconds=BOUND,
        ) as [consumer]:
            assert isinstance(consumer, EffectConsumer)
            with _readyz(consumer) as url:
                wait_until(lambda: scalar(engine, "SELECT count(*) FROM ledger") == 20, timeout=60)
                assert _status(url) == 200
                assert broker._proc is not None
                broker._proc.send_signal(signal.SIGSTOP)  # past the session and the bound
                stopped = time.monotonic()
                try:
                    wait_until(lambda: _status(url) == 503, timeout=SESSION_MS / 1000 + BOUND + 30)
                    assert time.monotonic() - stopped >= BOUND
                    wait_until(lambda: _rejoins(consumer) >= 1, timeout=BOUND + 30)
                finally:
                    broker._proc.send_signal(signal.SIGCONT)
                returned = time.monotonic()
                threading.Thread(
                    target=publish_events,
                    args=(broker.bootstrap_servers, codec, _credits(app, 20, first=20)),
                    daemon=True,
                ).start()
                wait_until(lambda: scalar(engine, "SELECT count(*) FROM ledger") == 40, timeout=60)
                wait_until(lambda: _status(url) == 200, timeout=30)
                print(f"rejoined and applied {time.monotonic() - returned:.1f} s after SIGCONT")
    finally:
        broker.stop()


def test_the_replay_dry_run_warns_while_the_group_has_members_and_says_when_a_killed_one_expires(
    new_ledger: Callable[..., App],
    engine: sa.Engine,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = new_ledger(1, ways=True)  # as tests.apps.ledger:effects, imported afresh
    monkeypatch.setenv("ONCELY_TEST_TOPIC_PREFIX", app.registry.topic_prefix)
    monkeypatch.setenv("ONCELY_TEST_GROUP_PREFIX", app.effects.group_prefix)
    monkeypatch.delitem(sys.modules, "tests.apps.ledger", raising=False)
    group = app.effects.group_id("ledger")
    replay = ["replay", "--app", "tests.apps.ledger:effects", "--effect", "ledger"]
    replay += ["--to-earliest", "--bootstrap-servers", kafka_bootstrap]

    def warnings(result: CliResult) -> list[str]:
        return [line for line in result.stderr.splitlines() if "active member" in line]

    idle = oncely_cli(*replay)
    config = KafkaSettings(bootstrap_servers=kafka_bootstrap).client_config()
    with running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap):
        wait_until(lambda: len(group_members(config, group)) == 1, timeout=60)
        busy, busy_json = oncely_cli(*replay), oncely_cli(*replay, "--json")
        refused = oncely_cli(*replay, "--execute")

    assert idle.exit_code == 0 and warnings(idle) == []
    assert busy.exit_code == 0, busy.output
    assert "dry run: 0 record(s) would be re-read" in busy.stdout
    (warning,) = warnings(busy)
    assert warning.startswith(f"warning: group '{group}' has 1 active member(s) (rdkafka@")
    assert warning.endswith(
        "stop its consumers, then replay (a consumer killed without leaving stays a member "
        "until its session expires: within the consumers' session timeout, "
        "ONCELY_CONSUMER_SESSION_TIMEOUT_MS, 45 s by default)"
    )
    document = json.loads(busy_json.stdout)
    assert document["executed"] is False
    assert [m["client_id"] for m in document["active_members"]] == ["rdkafka"]
    assert warnings(busy_json) == [warning]
    assert refused.exit_code == 2
    assert refused.stderr.splitlines()[-1] == warning.replace("warning:", "error:", 1)
