"""The pipeline against an authenticated broker (SASL SCRAM-SHA-512, with and without TLS).

The suite's secured devstack broker (``secure_kafka``, tests/integration/conftest.py) serves
the module. The processes run as ``oncely`` commands with their security settings in
``ONCELY_KAFKA_*`` variables, their logs captured, and those logs must not contain the
password. Refused credentials stop the relay and the consumer with exit status 2 and a message
naming the settings to fix, instead of retrying forever."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely.consumers.dlq import DeadLetters
from oncely.consumers.runner import EffectConsumer
from oncely.producer.staging import stage
from oncely.relay.housekeeping import Housekeeping
from oncely.relay.publisher import Publisher
from oncely.relay.relay import Relay
from oncely.relay.service import producer_config
from oncely.runtime.metrics import ConsumerMetrics, RelayMetrics
from oncely.schemas.codec import Codec
from oncely.security import KafkaAuthenticationError
from oncely.settings import ConsumerSettings, KafkaSettings, RetentionSettings
from oncely.storage.stores.outbox.relay import RelayStore
from tests.apps.ledger import App, build
from tests.helpers import (
    count_published,
    fast_settings,
    oncely_process,
    scalar,
    start_oncely,
    wait_until,
)
from tests.integration.secure_kafka import USER, SecureKafka

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ledger_tables")]

#: Shards some relay holds under a live lease.
_HELD_SHARDS = (
    "SELECT count(*) FROM oncely_relay_shards WHERE owner IS NOT NULL AND lease_until > now()"
)

APP = "tests.apps.ledger:effects"
#: The suite's Kafka settings, left out of the processes' environment: theirs are the secure
#: broker's.
_KAFKA = ["ONCELY_KAFKA_"]


@pytest.fixture
def app() -> App:
    """Not the shared ``app``: its topics are created on the secure broker (``oncely topics
    ensure``), not on the suite's."""
    prefix = f"sec{uuid.uuid4().hex[:10]}."
    return build(prefix, group_prefix=prefix)


def _environment(app: App, database_url: str, kafka: dict[str, str]) -> dict[str, str]:
    """Added to the suite's environment less its ``ONCELY_KAFKA_*`` variables (``_KAFKA``)."""
    return {
        **app.env,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2",
        "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2",
        **kafka,
    }


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    with log.open("wb") as sink:
        return start_oncely(*args, env=env, without=_KAFKA, stdout=sink, stderr=subprocess.STDOUT)


def _stage(engine: sa.Engine, app: App, count: int) -> None:
    with Session(engine) as session, session.begin():
        for n in range(count):
            stage(session, app.model(account_id=f"a{n % 4}", amount=n + 1, n=n))


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


@pytest.mark.timeout(240)
def test_pipeline_over_sasl_and_tls_leaks_no_secret(
    secure_kafka: SecureKafka, app: App, engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    sasl = _environment(app, database_url, secure_kafka.env(tls=False))
    # The consumer side uses TLS, its credentials in ONCELY_KAFKA_EXTRA (the escape hatch).
    tls = _environment(app, database_url, secure_kafka.env(tls=True))
    del tls["ONCELY_KAFKA_SASL_USERNAME"], tls["ONCELY_KAFKA_SASL_PASSWORD"]
    tls["ONCELY_KAFKA_EXTRA"] = json.dumps(
        {"sasl.username": USER, "sasl.password": secure_kafka.password, "client.id": "secure-test"}
    )
    outputs: list[str] = []

    ensure = oncely_process(
        "topics", "ensure", "--registry", "tests.apps.ledger:registry", env=tls, without=_KAFKA
    )
    outputs.append(ensure.stdout + ensure.stderr)
    assert ensure.returncode == 0 and "created" in ensure.stdout, outputs[-1]
    _stage(engine, app, 20)

    logs = [tmp_path / "relay.log", tmp_path / "consume.log"]
    relay = _start(["relay", "run"], sasl, logs[0])
    consumer = _start(["consume", APP, "--effect", "ledger"], tls, logs[1])
    try:
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM ledger") == 20, timeout=120)
        for command in (
            ["status", "--app", APP],
            ["verify", "--since", "1h", "--app", APP, "--effect", "ledger"],
        ):
            result = oncely_process(*command, env=tls, without=_KAFKA)
            outputs.append(result.stdout + result.stderr)
            assert result.returncode == 0, outputs[-1]
        assert "ledger" in outputs[1]
    finally:
        codes = [_stop(relay), _stop(consumer)]
    replay = oncely_process(
        *("replay", "--app", APP, "--effect", "ledger", "--to-earliest"), env=tls, without=_KAFKA
    )
    outputs.append(replay.stdout + replay.stderr)
    assert replay.returncode == 0, outputs[-1]
    outputs += [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[-2:]
    assert count_published(engine) == 20
    assert "relay started" in outputs[-2] and "consumers started" in outputs[-1]
    leaks = [text for text in outputs if secure_kafka.password in text]
    assert not leaks, f"the password appears in {len(leaks)} output(s)"


@pytest.mark.timeout(120)
def test_wrong_password_stops_relay_and_consumer_with_a_clear_message(
    secure_kafka: SecureKafka, app: App, engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    env = _environment(app, database_url, secure_kafka.env(tls=False, password=wrong))
    _stage(engine, app, 3)
    logs = [tmp_path / "relay.log", tmp_path / "consume.log"]
    started = time.monotonic()
    procs = [
        _start(["relay", "run"], env, logs[0]),
        _start(["consume", APP, "--effect", "ledger"], env, logs[1]),
    ]
    try:
        codes = [proc.wait(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    elapsed = time.monotonic() - started
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2], texts
    assert elapsed < 45, f"took {elapsed:.0f} s to give up"
    for text in texts:
        assert "ONCELY_KAFKA_SASL_PASSWORD" in text and "refused the credentials" in text, text
        assert wrong not in text
    # Nothing was read or kept: the rows and every shard wait for a relay that can log in.
    assert count_published(engine) == 0
    assert scalar(engine, _HELD_SHARDS) == 0


def test_loops_stop_when_credentials_are_refused_later(
    secure_kafka: SecureKafka, app: App, engine: sa.Engine
) -> None:
    # Credentials revoked while running: the loops' own checks, not the start-up ones.
    bad = KafkaSettings(
        bootstrap_servers=secure_kafka.sasl,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password="not-the-password",  # type: ignore[arg-type]
    )
    _stage(engine, app, 2)
    store = RelayStore(engine, owner="revoked")
    metrics = RelayMetrics()
    relay = Relay(
        store=store,
        publisher_factory=lambda: Publisher(
            producer_config(bad, fast_settings()), client=bad.client_config()
        ),
        settings=fast_settings(),
        metrics=metrics,
        housekeeping=Housekeeping(
            store=store,
            settings=fast_settings(),
            retention_settings=RetentionSettings(),
            kafka={},
            metrics=metrics.retention,
        ),
    )
    consumer = EffectConsumer(
        effect=app.effects.get("ledger"),
        group_id=app.effects.group_id("ledger"),
        codec=Codec(registry=app.registry),
        engine=engine,
        kafka=bad,
        settings=ConsumerSettings(poll_timeout_seconds=0.2),
        metrics=ConsumerMetrics(),
        dead_letters=DeadLetters({"bootstrap.servers": secure_kafka.plaintext}),
    )
    for run in (relay.run, consumer.run):
        stop = threading.Event()
        timer = threading.Timer(30, stop.set)  # a bound if the check were missing
        timer.start()
        try:
            with pytest.raises(KafkaAuthenticationError, match="ONCELY_KAFKA_SASL_PASSWORD"):
                run(stop)
        finally:
            timer.cancel()
        assert not stop.is_set()
    # The relay gave its shards back before raising, and recorded nothing.
    assert scalar(engine, _HELD_SHARDS) == 0
    assert count_published(engine) == 0
    consumer.dead_letters.close()
