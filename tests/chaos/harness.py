"""Scenario plumbing: a test app on its own topics, writers, and oncely processes to break."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from oncely import retention
from oncely.devstack._process import free_port
from oncely.producer.staging import stage
from oncely.retention.guard import Watermarks
from oncely.schemas.codec import Codec
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import upgrade
from oncely.storage.migrations import upgrade_connection
from tests.apps.ledger import App
from tests.chaos.ledger import check, published

#: The scenarios run on tables partitioned by the minute, with retention dropping partitions
#: behind them (:class:`Retention`).
STEP = timedelta(minutes=1)
#: Horizons of 0: a partition may go as soon as its minute is over and the guard lets it go,
#: so drops happen wherever a scenario's data ages past a minute boundary.
POLICY = retention.policy_of(
    RetentionSettings(ahead=2),
    RelaySettings(),
    outbox_horizon=timedelta(0),
    receipts_horizon=timedelta(0),
)
#: What each scenario's retention did, for the terminal summary (tests/chaos/conftest.py).
RETENTION_REPORTS: list[str] = []

#: Every row ever inserted into the outbox, kept by a trigger: the checks read what was staged
#: from here, as retention drops the outbox's partitions under them.
MIRROR = """
CREATE TABLE chaos_outbox (id uuid PRIMARY KEY, seq bigint, shard smallint, txid xid8,
                           topic text, aggregateid text, created_at timestamptz);
CREATE FUNCTION chaos_outbox_mirror() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO chaos_outbox VALUES (NEW.id, NEW.seq, NEW.shard, NEW.txid, NEW.topic,
                                     NEW.aggregateid, NEW.created_at);
    RETURN NULL; END $$;
CREATE TRIGGER chaos_outbox_mirror AFTER INSERT ON oncely_outbox
    FOR EACH ROW EXECUTE FUNCTION chaos_outbox_mirror();
"""


class Retention:
    """``retention.run`` every ``every`` seconds on a thread, as a maintenance job would: what
    it dropped, the refusals it reported (a lock not granted, Kafka or PostgreSQL not
    answering during a fault) and anything else it raised (a failure of the scenario)."""

    def __init__(
        self,
        engine: sa.Engine,
        bootstrap: str,
        *,
        policy: retention.Policy = POLICY,
        every: float = 3.0,
    ) -> None:
        self.engine, self.bootstrap, self.policy, self.every = engine, bootstrap, policy, every
        self.dropped: list[str] = []
        self.refusals: list[str] = []
        self.failures: list[str] = []
        self.runs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="retention")

    def __enter__(self) -> Retention:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def dropped_of(self, table: str) -> list[str]:
        return [name for name in self.dropped if name.startswith(f"{table}_p")]

    def _watermarks(self, topics: Iterable[str]) -> dict[str, Mapping[int, Watermarks] | None]:
        return retention.watermarks({"bootstrap.servers": self.bootstrap}, topics, timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.run_once()

    def run_once(self) -> None:
        try:
            outcome = retention.run(self.engine, self.policy, self._watermarks)
        except retention.KafkaUnansweredError as exc:
            self.refusals.append(f"kafka: {exc}")
            return
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            # PostgreSQL restarting or unreachable in a fault: the next run tries again.
            self.refusals.append(f"database: {type(exc.orig).__name__}")
            return
        except Exception as exc:  # any other error fails the scenario
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return
        self.runs += 1
        self.dropped += outcome.dropped
        for error in outcome.errors:
            (self.refusals if "lock not granted" in error else self.failures).append(error)
        self.refusals += [
            f"{v.partition.name}: {v.reason}"
            for v in outcome.kept
            if v.reason and "lock" in v.reason and "not granted" in v.reason
        ]

    def summary(self) -> str:
        return (
            f"runs={self.runs} dropped_outbox={len(self.dropped_of('oncely_outbox'))} "
            f"dropped_receipts={len(self.dropped_of('oncely_receipts'))} "
            f"refusals={len(self.refusals)} failures={len(self.failures)}"
        )


@dataclass
class Proc:
    """An ``oncely`` child process whose output is kept for the failure message."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    #: Run with ``python -m``: oncely's CLI, or a wrapper that runs it (a skewed clock, S13).
    module: str = "oncely"
    #: Where the process serves /metrics (``ONCELY_RELAY_METRICS_PORT``), if it does.
    metrics_port: int | None = None

    def start(self, **extra_env: str) -> Proc:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.argv],
                env={**self.env, **extra_env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _status(self, field: str) -> str | None:
        """A field of the running process's ``/proc/<pid>/status``; None once it exited."""
        if not self.alive():
            return None
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return line.split(":", 1)[1].strip()
        return None

    def peak_rss_mb(self) -> float:
        """The running process's peak resident memory (``VmHWM``), in MiB; 0 once it exited."""
        value = self._status("VmHWM")
        return int(value.split()[0]) / 1024 if value else 0.0

    def rss_mb(self) -> float:
        """The running process's resident memory now (``VmRSS``), in MiB; 0 once it exited."""
        value = self._status("VmRSS")
        return int(value.split()[0]) / 1024 if value else 0.0

    def stopped(self) -> bool:
        """The process is stopped by a signal (SIGSTOP, its own included)."""
        value = self._status("State")
        return value is not None and value.startswith("T")

    def metrics_text(self) -> str:
        """The process's /metrics page (raises ``OSError`` while it does not answer)."""
        assert self.metrics_port is not None, f"{self.log.stem} serves no metrics"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of the process's /metrics, summed over their labels."""
        values: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def published(self) -> float:
        """The relay's ``oncely_relay_published_total`` (-1 while /metrics does not answer)."""
        try:
            return self.metrics().get("oncely_relay_published_total", 0.0)
        except OSError:
            return -1.0

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(60)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Pipeline:
    engine: sa.Engine
    database_url: str
    bootstrap: str
    app: App
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    retention: Retention | None = None

    def staged(self) -> int:
        """Events committed into the outbox so far (retention drops its partitions: counted
        from the mirror, ``chaos_outbox``)."""
        return self.count("SELECT count(*) FROM chaos_outbox")

    def published(self) -> int:
        """Staged events the relay has passed (:func:`tests.chaos.ledger.published`)."""
        return published(self.engine)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "ONCELY_DATABASE_URL": self.database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "ONCELY_TEST_TOPIC_PREFIX": self.app.registry.topic_prefix,
            "ONCELY_TEST_GROUP_PREFIX": self.app.effects.group_prefix,
            "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.2",
            "ONCELY_RELAY_LEASE_SECONDS": "3",
            "ONCELY_RELAY_BACKOFF_BASE_SECONDS": "0.2",
            "ONCELY_RELAY_BACKOFF_MAX_SECONDS": "2",
            "ONCELY_RELAY_DELIVERY_TIMEOUT_MS": "5000",
            "ONCELY_CONSUMER_POLL_TIMEOUT_SECONDS": "0.2",
            "ONCELY_CONSUMER_SESSION_TIMEOUT_MS": "6000",
            "ONCELY_CONSUMER_ASSIGNMENT_TIMEOUT_SECONDS": "20",
        }

    def relay(
        self,
        name: str = "relay",
        *,
        module: str = "oncely",
        metrics: bool = False,
        defaults: bool = False,
    ) -> Proc:
        """A relay process named ``name`` (its log file and, unless set, not its relay id).

        ``metrics``: serve /metrics on a free port (:meth:`Proc.metrics`). ``defaults``: the
        relay's own default settings instead of the harness's short lease, poll and backoff.
        """
        env = self.env()
        if defaults:
            env = {k: v for k, v in env.items() if not k.startswith("ONCELY_RELAY_")}
        port = free_port() if metrics else None
        if port is not None:
            env["ONCELY_RELAY_METRICS_PORT"] = str(port)
        proc = Proc(
            ["relay", "run", "--log-format", "text"],
            env,
            self.log_dir / f"{name}.log",
            module=module,
            metrics_port=port,
        )
        self.procs.append(proc)
        return proc

    def shard_owners(self) -> dict[str, int]:
        """How many shards each relay holds now (a live lease on the database clock)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT owner, count(*) FROM oncely_relay_shards"
                    " WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner"
                )
            ).all()
        return {str(owner): int(count) for owner, count in rows}

    def consumer(self, *effects: str, name: str | None = None) -> Proc:
        """An ``oncely consume`` process for ``effects`` (default: the ledger effect)."""
        effects = effects or ("ledger",)
        proc = Proc(
            [
                "consume",
                "tests.apps.ledger:effects",
                *(arg for effect in effects for arg in ("--effect", effect)),
                "--log-format",
                "text",
            ],
            self.env(),
            self.log_dir / f"{name or '-'.join(effects)}.log",
        )
        self.procs.append(proc)
        return proc

    def peak_memory(self) -> str:
        """``name:MiB`` of each running process's peak resident memory, for the reports."""
        peaks = (f"{p.log.stem}:{p.peak_rss_mb():.0f}" for p in self.procs if p.alive())
        return "peak_rss_mb=" + ",".join(peaks)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.log.name}\n{p.log.read_text(errors='replace')[-3000:]}"
            for p in self.procs
            if p.log.exists()
        )

    def write(
        self,
        count: int,
        *,
        keys: int = 20,
        rollback_every: int = 0,
        seed: int = 0,
        key_prefix: str = "acc-",
    ) -> None:
        """Stage ``count`` events in business transactions (one event each); every
        ``rollback_every``-th transaction is rolled back after staging. Keys are
        ``key_prefix`` and a number below ``keys``: writers running at once use prefixes of
        their own (one writer per key, so that commit order is ``seq`` order)."""
        codec = Codec(registry=self.app.registry)
        rng = random.Random(seed)
        for i in range(count):
            with Session(self.engine) as session:
                session.begin()
                account = f"{key_prefix}{rng.randrange(keys)}"
                event = self.app.model(account_id=account, amount=i + 1, n=i)
                staged = stage(session, event, codec=codec)
                keep = not (rollback_every and i % rollback_every == rollback_every - 1)
                if keep:
                    session.execute(
                        sa.text(
                            "INSERT INTO chaos_business (event_id, committed) VALUES (:e, true)"
                        ),
                        {"e": staged.id},
                    )
                    session.commit()
                else:
                    session.rollback()
                    with self.engine.begin() as conn:
                        conn.execute(
                            sa.text(
                                "INSERT INTO chaos_business (event_id, committed)"
                                " VALUES (:e, false)"
                            ),
                            {"e": staged.id},
                        )

    def write_in_background(self, count: int, **kwargs: object) -> threading.Thread:
        thread = threading.Thread(target=self.write, args=(count,), kwargs=kwargs, daemon=True)
        thread.start()
        return thread

    def write_until(
        self,
        stop: threading.Event,
        *,
        keys: int = 20,
        rollback_every: int = 13,
        pause: float = 0.25,
        key_prefix: str = "acc-",
    ) -> threading.Thread:
        """On a thread, stage batches of ``rollback_every`` events (one rolled back in each)
        every ``pause`` seconds (a quarter second: about 50 a second; 0: as fast as one writer
        can) until ``stop`` is set. One writer, so that commit order is ``seq`` order."""

        def run() -> None:
            batch = 0
            while not stop.is_set():
                self.write(
                    rollback_every,
                    keys=keys,
                    rollback_every=rollback_every,
                    seed=batch,
                    key_prefix=key_prefix,
                )
                batch += 1
                time.sleep(pause)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def count(self, sql: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())

    def wait_applied(self, expected: int, *, effect: str = "ledger", timeout: float = 120) -> float:
        """Wait until ``expected`` receipts of ``effect`` exist; return the seconds it took."""
        started = time.monotonic()
        applied = f"SELECT count(*) FROM oncely_receipts WHERE effect = '{effect}'"
        while self.count(applied) < expected:
            if time.monotonic() - started > timeout:
                report = check(
                    self.engine, self.bootstrap, topics=[self.app.topic], effects=[effect]
                )
                raise AssertionError(
                    f"only {self.count(applied)} of {expected} {effect} effects applied after "
                    f"{timeout} s: {report.summary()}\n{self.logs()}"
                )
            time.sleep(0.2)
        return time.monotonic() - started


@contextmanager
def pipeline(
    engine: sa.Engine,
    database_url: str,
    bootstrap: str,
    app: App,
    log_dir: Path,
    *,
    policy: retention.Policy = POLICY,
    retention_every: float = 3.0,
    partition_every: timedelta | None = STEP,
) -> Iterator[Pipeline]:
    """The scenario's pipeline on partitioned tables (1-minute steps; unpartitioned with
    ``partition_every`` ``None``: a scenario converts them, :func:`convert`), with
    :class:`Retention` running through it; on a clean exit, fails if retention raised anything
    but a refusal."""
    upgrade(engine, partition_every=partition_every)
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE chaos_business (event_id uuid PRIMARY KEY, committed boolean)")
        )
        conn.exec_driver_sql(MIRROR)
    running = Pipeline(engine, database_url, bootstrap, app, log_dir)
    keeper = Retention(engine, bootstrap, policy=policy, every=retention_every)
    running.retention = keeper
    try:
        with keeper:
            yield running
    finally:
        for proc in running.procs:
            proc.stop()
        scenario = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        RETENTION_REPORTS.append(f"{scenario}: {keeper.summary()}")
        print(f"retention {keeper.summary()} dropped={keeper.dropped}")
    assert not keeper.failures, f"retention failed: {keeper.failures}"


def convert(engine: sa.Engine, step: timedelta = STEP) -> None:
    """``oncely db upgrade --partition-every`` on the pipeline's unpartitioned tables, with the
    mirror's trigger moved to the new outbox in the same transaction (so that no row staged
    during the conversion is missed by the checks, nor mirrored twice)."""
    with engine.begin() as conn:
        upgrade_connection(conn, partition_every=step)
        conn.exec_driver_sql(
            "CREATE TRIGGER chaos_outbox_mirror AFTER INSERT ON oncely_outbox"
            " FOR EACH ROW EXECUTE FUNCTION chaos_outbox_mirror()"
        )


def unique_prefix() -> str:
    return f"c{uuid.uuid4().hex[:10]}."
