"""The payments demo: the whole pipeline as separate processes, with faults, checked at the end.

``oncely demo`` (what ``make demo`` runs) calls :func:`run_demo`. It upgrades the database,
creates the topics, starts a relay, two effect consumer groups and a task worker as separate
``oncely`` processes, and drives transfers from several writer threads (some retried with the
same idempotency key). With chaos on, it kills the relay with SIGKILL mid-run and restarts it,
lets the ``ledger-projection`` consumer die between its database commit and its offset commit
(a failpoint), and finally replays that group from the earliest offset. A live view shows the
counters; the run ends with an invariants table and a non-zero exit if any fails.

The table reports throughput and commit-to-effect p50/p99 of the ``ledger-projection`` effect
overall and outside the fault windows, and a second table lists the windows: from each fault to
the moment the pipeline caught up with it (:mod:`examples.payments.faults` defines them).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

import oncely
from examples.payments import faults
from examples.payments.effects import effects
from examples.payments.events import registry
from examples.payments.models import metadata
from examples.payments.service import TransferService
from oncely.consumers.replay import Earliest, execute_reset, plan_reset
from oncely.devstack._process import free_port
from oncely.ops.verify import verify_window
from oncely.settings import TopicSettings
from oncely.storage import upgrade
from oncely.topics import ensure_topics, planned_topics

EFFECTS = ("send-receipt", "ledger-projection")
MEASURED = "ledger-projection"  # the effect whose commit-to-effect trips the figures count
WINDOWS_NOTE = (
    "A fault window runs from the fault until every event committed before the process was back"
    " has its ledger effect (the replay: until every record was re-read). An event is inside"
    " when committed in a window or still in flight when one opened. Latency: commit → effect;"
    " throughput: events over the run's seconds (first commit to last effect), the outside"
    " figure over those seconds less the windows'."
)


@dataclass
class Options:
    events: int = 5000
    chaos: bool = True
    writers: int = 4
    #: Transfers per second the writers offer, open loop (0: as fast as they can).
    rate: float = 50.0
    keep_running: bool = False
    timeout_seconds: float = 240.0


@dataclass
class _Process:
    """One ``oncely`` child process, restartable, with its stderr kept in a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_dir: Path
    metrics_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self, **extra_env: str) -> None:
        self.starts += 1
        log = (self.log_dir / f"{self.name}.{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "oncely", *self.argv],
            env={**self.env, **extra_env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def ready(self) -> bool:
        """``/readyz`` answers 200 (processes without a metrics port: running)."""
        if self.metrics_port is None:
            return self.alive()
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """Sum of each sample name over its labels, from the process's /metrics."""
        if self.metrics_port is None or not self.alive():
            return {}
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=1) as response:
                text = response.read().decode()
        except OSError:
            return {}
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals


@dataclass
class _Counters:
    requested: int = 0
    retried: int = 0
    duplicates_seen: int = 0
    chaos: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, text: str) -> None:
        with self.lock:
            self.chaos.append(f"{datetime.now(UTC):%H:%M:%S} {text}")


class Demo:
    def __init__(self, *, database_url: str, bootstrap: str, options: Options) -> None:
        self.database_url = database_url
        self.bootstrap = bootstrap
        self.options = options
        self.engine = sa.create_engine(database_url, pool_size=options.writers + 4)
        self.counters = _Counters()
        self.log_dir = Path(tempfile.mkdtemp(prefix="oncely-demo-"))
        self.started = datetime.now(UTC)
        self.cpu_started = _cpu_times()
        #: How long the writers took (set when they are done).
        self.writing_seconds = 0.0
        self.topics = sorted({t.topic for t in registry})
        env = {
            **os.environ,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "ONCELY_RELAY_POLL_INTERVAL_SECONDS": "0.5",
            # A killed relay's shards are taken over after this lease (the default is 6 s),
            # and a crashed consumer's partitions after this session timeout (default 45 s).
            "ONCELY_RELAY_LEASE_SECONDS": "5",
            "ONCELY_CONSUMER_SESSION_TIMEOUT_MS": "6000",
            # Consumers decode every committed version of the example's event types.
            "ONCELY_SCHEMAS_DIR": str(Path(__file__).resolve().parents[2] / "schemas"),
            "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
        }
        app = "examples.payments.effects:effects"
        self.relay = _Process("relay", ["relay", "run"], env, self.log_dir, free_port())
        self.relay.argv += ["--metrics-port", str(self.relay.metrics_port)]
        self.consumers = {
            name: _Process(name, ["consume", app, "--effect", name], env, self.log_dir, free_port())
            for name in EFFECTS
        }
        for consumer in self.consumers.values():
            consumer.argv += ["--metrics-port", str(consumer.metrics_port)]
        self.worker = _Process(
            "task-worker", ["tasks", "run", "examples.payments.tasks:tasks"], env, self.log_dir
        )
        self._view_client: Consumer | None = None
        self._view_lock = threading.Lock()
        self._start_offsets = self._high_watermarks()
        self.faults: list[faults.Fault] = []
        self._coming_back: list[tuple[faults.Fault, _Process]] = []

    # -- set-up ---------------------------------------------------------------------------

    def prepare(self) -> None:
        upgrade(self.engine)
        metadata.create_all(self.engine)
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        ensure_topics(admin, planned_topics(registry, TopicSettings(partitions=6)))
        self._start_offsets = self._high_watermarks()

    def start_processes(self) -> None:
        self.relay.start()
        self.consumers["send-receipt"].start()
        failpoint = {
            "ONCELY_FAILPOINTS": "consumer.after_db_commit_before_offset_commit=exit-after:2"
        }
        self.consumers["ledger-projection"].start(**(failpoint if self.options.chaos else {}))
        self.worker.start()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        processes = [self.relay, *self.consumers.values(), self.worker]
        while not all(p.ready() for p in processes):
            dead = [p.name for p in processes if not p.alive()]
            if dead or time.monotonic() > deadline:
                raise oncely.OncelyError(
                    f"processes not ready ({', '.join(dead) or 'timed out'}); logs: {self.log_dir}"
                )
            time.sleep(0.2)

    def stop_processes(self) -> None:
        for process in [self.relay, *self.consumers.values(), self.worker]:
            process.stop()

    # -- load -----------------------------------------------------------------------------

    def write(self) -> None:
        service = TransferService(self.engine)
        per_writer = self.options.events // self.options.writers
        extra = self.options.events - per_writer * self.options.writers

        rate, writers = self.options.rate, self.options.writers
        started = time.monotonic() + 0.1

        def writer(index: int, count: int) -> None:
            rng = random.Random(index)  # noqa: S311 (load generation, not security)
            for n in range(count):
                if rate > 0:  # open loop: transfer k is due at start + k / rate
                    delay = started + (index + n * writers) / rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                key = f"req-{uuid.uuid4()}"
                request: dict[str, Any] = {
                    "idempotency_key": key,
                    "from_account": f"acc-{rng.randrange(200)}",
                    "to_account": f"acc-{rng.randrange(200)}",
                    "amount": Decimal(rng.randrange(100, 600_000)) / 100,
                }
                service.request_transfer(**request)
                with self.counters.lock:
                    self.counters.requested += 1
                if rng.random() < 0.05:  # the client did not hear back and retries
                    again = service.request_transfer(**request)
                    with self.counters.lock:
                        self.counters.retried += 1
                        self.counters.duplicates_seen += bool(again.get("duplicate"))

        threads = [
            threading.Thread(target=writer, args=(i, per_writer + (i < extra)), daemon=True)
            for i in range(self.options.writers)
        ]
        for thread in threads:
            thread.start()
        killed = False
        while any(t.is_alive() for t in threads):
            if (
                self.options.chaos
                and not killed
                and self.counters.requested > self.options.events * 0.3
            ):
                fault = self._fault("relay SIGKILL")
                self.relay.signal(signal.SIGKILL)
                self.counters.note("relay killed with SIGKILL mid-run")
                time.sleep(1.0)
                self.relay.start()
                self._coming_back.append((fault, self.relay))
                self.counters.note("relay restarted")
                killed = True
            self.watch()
            time.sleep(0.1)
        self.writing_seconds = time.monotonic() - started

    def watch(self) -> None:
        """Restart a consumer that its failpoint killed; note the restarted processes back."""
        ledger = self.consumers["ledger-projection"]
        if ledger.proc is not None and ledger.proc.poll() == 137:
            fault = self._fault("ledger crash (after DB commit)")
            self.counters.note("ledger-projection died between its DB commit and offset commit")
            ledger.start()
            self._coming_back.append((fault, ledger))
            self.counters.note("ledger-projection restarted (redelivered records are duplicates)")
        for fault, process in list(self._coming_back):
            if process.ready():
                fault.back = self.db_now()
                self._coming_back.remove((fault, process))

    def db_now(self) -> datetime:
        """The database's clock: fault times compare with the rows' timestamps."""
        with self.engine.connect() as conn:
            now: datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        return now

    def _fault(self, name: str) -> faults.Fault:
        fault = faults.Fault(name, started=self.db_now())
        self.faults.append(fault)
        return fault

    def replay_ledger(self) -> faults.Fault:
        """Stop ledger-projection, reset it to the earliest offsets, start it again.

        Returns the fault; the caller sets its ``caught_up`` once every record was re-read.
        """
        ledger = self.consumers["ledger-projection"]
        fault = self._fault("ledger replay")
        for pending in [p for p in self._coming_back if p[1] is ledger]:
            # Stopped before it answered: the earlier fault ends where the replay begins.
            pending[0].back = fault.started
            self._coming_back.remove(pending)
        ledger.stop()
        config: dict[str, str | int | float | bool] = {"bootstrap.servers": self.bootstrap}
        group = effects.group_id("ledger-projection")
        topics = effects.get("ledger-projection").topics
        # The broker may still list the stopped member for a moment.
        deadline = time.monotonic() + 30
        while True:
            try:
                moves = plan_reset(config, group=group, topics=topics, target=Earliest())
                execute_reset(config, group=group, moves=moves)
                break
            except oncely.OncelyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        reread = sum(m.to_reread for m in moves)
        self.counters.note(f"ledger-projection replayed to earliest: {reread} records to re-read")
        fault.name += f" ({reread} re-read)"
        ledger.start()
        self._coming_back.append((fault, ledger))
        return fault

    def trips(self) -> list[faults.Trip]:
        """Commit and first application of each event of this run by the measured effect."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT o.created_at, r.applied_at FROM oncely_receipts r"
                    " JOIN oncely_outbox o ON o.id = r.event_id"
                    " WHERE o.created_at >= :s AND r.effect = :effect"
                ),
                {"s": self.started, "effect": MEASURED},
            ).all()
        return [faults.Trip(committed, applied) for committed, applied in rows]

    # -- observation ----------------------------------------------------------------------

    def _high_watermarks(self) -> dict[tuple[str, int], int]:
        """High watermarks of the payment topics; a partition that does not answer is left out.

        One Kafka client serves every look (a new one each time cost the machine more than the
        pipeline it watches: connections, metadata and threads twice a second)."""
        with self._view_lock:
            if self._view_client is None:
                self._view_client = Consumer(
                    {"bootstrap.servers": self.bootstrap, "group.id": "oncely-demo-view"}
                )
            consumer = self._view_client
            marks = {}
            metadata_ = consumer.list_topics(timeout=10)
            for topic in self.topics:
                for partition in (metadata_.topics.get(topic) or _NoTopic()).partitions:
                    tp = TopicPartition(topic, partition)
                    with contextlib.suppress(KafkaException):
                        marks[(topic, partition)] = consumer.get_watermark_offsets(tp, timeout=5)[1]
            return marks

    def close(self) -> None:
        """Close the view's Kafka client and the engine."""
        if self._view_client is not None:
            self._view_client.close()
            self._view_client = None
        self.engine.dispose()

    def snapshot(self) -> dict[str, float]:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    """
                    WITH rows AS (
                        -- Published: the row's shard recorded progress past it (the relay
                        -- never updates a row); held or dead rows of a parked key are not.
                        SELECT o.type,
                               (pg_visible_in_snapshot(o.txid, s.done)
                                OR (s.reading IS NOT NULL AND o.seq <= s.after_seq
                                    AND pg_visible_in_snapshot(o.txid, s.reading)))
                               AND o.id NOT IN (SELECT event_id FROM oncely_relay_held)
                               AND o.id NOT IN (SELECT event_id FROM oncely_relay_parked)
                               AS published
                        FROM oncely_outbox AS o
                        JOIN oncely_relay_shards AS s ON s.shard = o.shard
                        WHERE o.created_at >= :since
                    )
                    SELECT count(*) AS staged,
                           count(*) FILTER (WHERE published) AS published,
                           count(*) FILTER (WHERE NOT published) AS backlog,
                           count(*) FILTER (WHERE type = 'transfer.completed') AS completed
                    FROM rows
                    """
                ),
                {"since": self.started},
            ).one()
            applied: dict[str, int] = dict(
                conn.execute(
                    sa.text(
                        "SELECT r.effect, count(*) FROM oncely_receipts r JOIN oncely_outbox o"
                        " ON o.id = r.event_id WHERE o.created_at >= :since GROUP BY r.effect"
                    ),
                    {"since": self.started},
                ).all()
            )
            emails = conn.execute(
                sa.text(
                    "SELECT count(*), coalesce(sum(calls), 0) FROM provider_emails"
                    " WHERE sent_at >= :since"
                ),
                {"since": self.started},
            ).one()
        marks = self._high_watermarks()
        records = sum(high - self._start_offsets.get(tp, 0) for tp, high in marks.items())
        scraped = [c.metrics() for c in self.consumers.values()]
        duplicates = sum(m.get("oncely_consumer_duplicates_suppressed_total", 0.0) for m in scraped)
        lag = sum(m.get("oncely_consumer_lag_records", 0.0) for m in scraped)
        return {
            "staged": row.staged,
            "published": row.published,
            "backlog": row.backlog,
            "completed": row.completed,
            "records": records,
            **{f"applied:{name}": applied.get(name, 0) for name in EFFECTS},
            "duplicates": duplicates,
            "lag": lag,
            "emails": emails[0],
            "email_calls": emails[1],
        }


class _NoTopic:
    partitions: dict[int, object] = {}


def _view(demo: Demo, snap: dict[str, float], elapsed: float, phase: str) -> Group:
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.completed:>8.0f}"),
    )
    total = max(1, demo.options.events)
    progress.add_task("transfers requested", total=total, completed=demo.counters.requested)
    staged = max(1, snap.get("staged", 0))
    progress.add_task("events published", total=staged, completed=int(snap.get("published", 0)))
    completed = max(1, snap.get("completed", 0))
    for name in EFFECTS:
        done = int(snap.get(f"applied:{name}", 0))
        progress.add_task(f"applied: {name}", total=completed, completed=done)
    emails = int(snap.get("emails", 0))
    progress.add_task("emails sent (task worker)", total=completed, completed=emails)
    table = Table(show_header=False, box=None)
    rate = snap.get("published", 0) / elapsed if elapsed else 0
    for label, value in [
        ("phase", phase),
        ("staged events", f"{snap.get('staged', 0):.0f}"),
        ("Kafka records", f"{snap.get('records', 0):.0f}"),
        ("backlog (outbox unpublished)", f"{snap.get('backlog', 0):.0f}"),
        ("consumer lag", f"{snap.get('lag', 0):.0f}"),
        ("duplicates suppressed", f"{snap.get('duplicates', 0):.0f}"),
        ("retried requests (same key)", f"{demo.counters.retried}"),
        ("events/s published", f"{rate:.0f}"),
    ]:
        table.add_row(label, value)
    chaos = Table(show_header=False, box=None)
    for line in demo.counters.chaos[-6:]:
        chaos.add_row(f"[yellow]{line}[/]")
    return Group(progress, table, chaos)


def _invariants(demo: Demo, snap: dict[str, float]) -> tuple[Table, Table | None, bool]:
    """The invariants table, the fault windows table (None without faults), all invariants ok."""
    with demo.engine.connect() as conn:
        dup_effects = conn.execute(
            sa.text(
                "SELECT count(*) FROM (SELECT transfer_id FROM ledger_entries GROUP BY transfer_id"
                " HAVING count(*) <> 2) AS d"
            )
        ).scalar_one()
        max_calls = conn.execute(
            sa.text("SELECT coalesce(max(calls), 0) FROM provider_emails WHERE sent_at >= :s"),
            {"s": demo.started},
        ).scalar_one()
    report = demo_verify(demo)
    trips = demo.trips()
    figures = faults.report(demo.faults, trips)
    requested = f"{demo.counters.requested} (+{demo.counters.retried} retried with the same key)"
    completed = snap["completed"]
    rows: list[tuple[str, str, bool]] = [
        ("transfers requested", requested, demo.counters.duplicates_seen == demo.counters.retried),
        ("events committed", f"{snap['staged']:.0f}", snap["staged"] > 0),
        ("events published", f"{snap['published']:.0f}", snap["published"] == snap["staged"]),
        ("lost (committed, not in Kafka)", str(report["lost"]), report["lost"] == 0),
    ]
    for name in EFFECTS:
        applied = snap[f"applied:{name}"]
        rows.append(
            (f"effects applied: {name}", f"{applied:.0f} of {completed:.0f}", applied == completed)
        )
    rows += [
        ("duplicate effects", str(dup_effects), dup_effects == 0),
        ("order violations", str(report["out_of_order"]), report["out_of_order"] == 0),
        ("provider calls per idempotency key", f"max {max_calls}", max_calls == 1),
        ("emails sent", f"{snap['emails']:.0f} of {completed:.0f}", snap["emails"] == completed),
        ("duplicates suppressed by receipts", f"{snap['duplicates']:.0f}", True),
        ("fault windows", _windows_summary(figures), True),
        ("offered load", _offered(demo), True),
        ("machine CPU idle during the run", _cpu_idle(demo), True),
        ("throughput (ledger), overall", _throughput(figures.overall), True),
        ("throughput (ledger), outside fault windows", _throughput(figures.outside), True),
        ("commit → effect (ledger), overall", _latency(figures.overall), True),
        ("commit → effect (ledger), outside fault windows", _latency(figures.outside), True),
    ]
    table = Table(title="oncely demo — invariants (computed from this run)")
    table.add_column("invariant")
    table.add_column("value")
    table.add_column("ok")
    for name, value, ok in rows:
        table.add_row(name, value, "[green]✔[/]" if ok else "[red]✘[/]")
    return table, _windows_table(figures, trips), all(ok for _, _, ok in rows)


def _offered(demo: Demo) -> str:
    """The writers' schedule and what they achieved over the writing."""
    seconds = demo.writing_seconds
    achieved = demo.counters.requested / seconds if seconds > 0 else 0.0
    writers = demo.options.writers
    if demo.options.rate > 0:
        return f"{demo.options.rate:g} transfers/s open loop; achieved {achieved:.0f}/s"
    return f"as fast as {writers} writers go (closed loop): {achieved:.0f} transfers/s"


def _cpu_times() -> tuple[int, int] | None:
    """(idle + iowait, total) jiffies of the whole machine (Linux ``/proc/stat``), else None."""
    try:
        with Path("/proc/stat").open() as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])


def _cpu_idle(demo: Demo) -> str:
    """The machine's CPU idle share since the first transfer: the latencies mean little on a
    machine that had none to spare (other work, or a smaller machine than the demo needs)."""
    before, after = demo.cpu_started, _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return "unknown (no /proc/stat)"
    return f"{(after[0] - before[0]) / (after[1] - before[1]):.0%}"


def _throughput(figures: faults.Figures) -> str:
    rate = figures.per_second
    shown = "-" if rate is None else f"{rate:.0f}"
    return f"{shown} events/s ({figures.events} events in {figures.seconds:.1f} s)"


def _latency(figures: faults.Figures) -> str:
    if figures.p50_ms is None or figures.p99_ms is None:
        return "no events"
    return f"p50 {figures.p50_ms:.0f} ms, p99 {figures.p99_ms:.0f} ms ({figures.events} events)"


def _windows_summary(figures: faults.Report) -> str:
    if not figures.windows:
        return "none (no faults injected)"
    found = [window for window, _ in figures.windows]
    whole = (min(w.start for w in found), max(w.end for w in found))
    seconds = faults.covered_seconds(whole, found)
    return f"{len(found)}, covering {seconds:.1f} s; {figures.inside} events inside"


def _windows_table(figures: faults.Report, trips: list[faults.Trip]) -> Table | None:
    """One row per fault window, times in seconds from the run's first commit."""
    if not figures.windows:
        return None
    zero = faults.span(trips)
    origin = zero[0] if zero is not None else min(w.start for w, _ in figures.windows)
    table = Table(title="fault windows (seconds from the first commit)")
    for column in ("fault", "start", "end", "length", "events inside", "worst latency"):
        table.add_column(column, justify="left" if column == "fault" else "right")
    for window, inside in figures.windows:
        worst = max((t.latency_ms for t in inside), default=None)
        table.add_row(
            window.name,
            f"{(window.start - origin).total_seconds():.1f}",
            f"{(window.end - origin).total_seconds():.1f}",
            f"{window.seconds:.1f} s",
            str(len(inside)),
            "-" if worst is None else f"{worst:.0f} ms",
        )
    return table


def demo_verify(demo: Demo) -> dict[str, int]:
    """Lost records and order violations of this run, by ``oncely verify``'s checks."""
    report = verify_window(
        demo.engine,
        kafka_config={"bootstrap.servers": demo.bootstrap},
        effects=[effects.get(name) for name in EFFECTS],
        since=demo.started,
    )
    return {"lost": report.lost, "out_of_order": report.problems["out_of_order"]}


def run_demo(*, database_url: str, bootstrap: str, options: Options, console: Console) -> int:
    """Run the demo against these services; return the exit code (0: every invariant held)."""
    demo = Demo(database_url=database_url, bootstrap=bootstrap, options=options)
    demo.prepare()
    demo.start_processes()
    console.print("starting relay, consumers and task worker ...")
    demo.wait_ready()
    demo.started = demo.db_now()
    demo.cpu_started = _cpu_times()
    started = time.monotonic()
    phase = ["writing transfers"]
    try:
        with Live(console=console, refresh_per_second=4) as live:
            stop_view = threading.Event()

            def refresh() -> None:
                while not stop_view.is_set():
                    live.update(_view(demo, demo.snapshot(), time.monotonic() - started, phase[0]))
                    stop_view.wait(0.5)

            viewer = threading.Thread(target=refresh, daemon=True)
            viewer.start()
            demo.write()
            phase[0] = "draining: relay, consumers, task worker"
            _wait(demo, lambda s: _all_done(s), options.timeout_seconds)
            if options.chaos:
                phase[0] = "replaying ledger-projection from the earliest offset"
                replay = demo.replay_ledger()
                _wait(
                    demo,
                    lambda s: (
                        demo.consumers["ledger-projection"]
                        .metrics()
                        .get("oncely_consumer_duplicates_suppressed_total", 0)
                        >= s["completed"]
                    ),
                    options.timeout_seconds,
                )
                replay.caught_up = demo.db_now()
            phase[0] = "done"
            stop_view.set()
            viewer.join()
            elapsed = time.monotonic() - started
            snap = demo.snapshot()
            live.update(_view(demo, snap, elapsed, phase[0]))
        table, windows, ok = _invariants(demo, snap)
        console.print()
        console.print(table)
        if windows is not None:
            console.print(windows)
            console.print(WINDOWS_NOTE, soft_wrap=False)
        console.print(f"process logs: {demo.log_dir}")
        if options.keep_running:
            console.print("processes keep running; Ctrl-C stops them")
            while True:
                time.sleep(1)
        return 0 if ok else 1
    finally:
        demo.stop_processes()
        demo.close()


def _all_done(snap: dict[str, float]) -> bool:
    return (
        snap["published"] == snap["staged"]
        and all(snap[f"applied:{name}"] == snap["completed"] for name in EFFECTS)
        and snap["emails"] == snap["completed"]
    )


def _wait(demo: Demo, done: Callable[[dict[str, float]], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        demo.watch()
        snap = demo.snapshot()
        if done(snap):
            return
        if time.monotonic() > deadline:
            raise oncely.OncelyError(
                f"the pipeline did not finish within {timeout:.0f} s: {snap}; logs: {demo.log_dir}"
            )
        time.sleep(0.5)
