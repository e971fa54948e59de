"""What the benchmark cells run on: a database with oncely's tables, topics, staged rows, and
the sides under test (relay processes), with the drain and latency measurements they share."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_LOG_APPEND_TIME, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from psycopg.types.json import Jsonb

from bench.harness import Window, cpu_window, open_loop
from oncely.devstack._process import free_port
from oncely.relay import build_relay
from oncely.runtime.metrics import RelayMetrics
from oncely.settings import KafkaSettings, RelaySettings
from oncely.storage import outbox
from oncely.testing.services import libpq_dsn

PAYLOAD = b"x" * 200

#: A side: a context manager that runs the thing under test (a relay, a connector) for a block.
Side = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass
class Bench:
    """The services and knobs of one benchmark run."""

    engine: sa.Engine
    database_url: str
    bootstrap: str
    rows: int
    keys: int
    batch_size: int = RelaySettings().batch_size
    partitions: int = 6

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap})

    def new_topic(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        admin = self.admin()
        admin.create_topics([NewTopic(name, num_partitions=self.partitions)])[name].result(30)
        return name

    def relay_settings(self) -> RelaySettings:
        """The relay's defaults, with the bench's page size and no purge during a run."""
        return RelaySettings(batch_size=self.batch_size, purge_interval_seconds=3600)

    def relay_env(self) -> dict[str, str]:
        """The environment of an ``oncely relay run`` process with :meth:`relay_settings`."""
        settings = self.relay_settings()
        return {
            "ONCELY_DATABASE_URL": self.database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "ONCELY_RELAY_BATCH_SIZE": str(settings.batch_size),
            "ONCELY_RELAY_PURGE_INTERVAL_SECONDS": str(settings.purge_interval_seconds),
        }


def delete_topic(bench: Bench, topic: str) -> None:
    """Delete ``topic`` (and wait for the broker to say so)."""
    admin = bench.admin()
    for future in admin.delete_topics([topic]).values():
        future.result(30)


def staged_rows(count: int, *, topic: str, keys: int) -> list[dict[str, object]]:
    """Rows as a producer stages them: ``count`` events over ``keys`` keys, 200-byte payloads."""
    return [
        {
            "id": uuid.uuid4(),
            "aggregatetype": "account",
            "aggregateid": f"key-{i % keys}",
            "type": "bench.event",
            "topic": topic,
            "payload": PAYLOAD,
            "headers": {"content-type": "application/octet-stream"},
            "event_key": f"bench-{uuid.uuid4().hex}",
        }
        for i in range(count)
    ]


def insert_fresh(
    conn: sa.Connection, rows: list[dict[str, object]], *, topic: str | None = None
) -> None:
    """Insert ``rows`` into the outbox with fresh ids and event keys (and ``topic`` when given),
    5,000 per statement."""
    extra: dict[str, object] = {"topic": topic} if topic is not None else {}
    for start in range(0, len(rows), 5000):
        chunk = [
            {**row, "id": uuid.uuid4(), "event_key": uuid.uuid4().hex, **extra}
            for row in rows[start : start + 5000]
        ]
        conn.execute(sa.insert(outbox), chunk)


def restage(bench: Bench, rows: list[dict[str, object]]) -> None:
    """Empty the outbox and stage ``rows`` again (fresh ids), then refresh the statistics."""
    with bench.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_outbox"))
        insert_fresh(conn, rows)
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE oncely_outbox"))


def commit_at_once(bench: Bench, rows: list[dict[str, object]], topic: str) -> float:
    """Stage ``rows`` (fresh ids, ``topic``) in one transaction; return when it committed."""
    with bench.engine.begin() as conn:
        insert_fresh(conn, rows, topic=topic)
    return time.time()


# -- processes -------------------------------------------------------------------------------


@dataclass
class Running:
    """One ``oncely`` process of a side: its metrics port, process and (JSON) log."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def processes(argv: list[str], count: int, env: dict[str, str]) -> Iterator[list[Running]]:
    """``count`` ``oncely`` processes, each with its own metrics port; SIGTERMed afterwards.

    Their output goes to ``$ONCELY_BENCH_LOG_DIR`` (default: ``oncely-bench`` in the temporary
    folder; each log is named after the command and its port).
    """
    logs = Path(
        os.environ.get("ONCELY_BENCH_LOG_DIR") or Path(tempfile.gettempdir(), "oncely-bench")
    )
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(count)]
    running = []
    for port in ports:
        path = logs / f"{argv[0]}-{port}.log"
        with path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "oncely", *argv, "--metrics-port", str(port)],
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        running.append(Running(port, proc, path))
    try:
        yield running
    finally:
        for each in running:
            each.proc.terminate()
        for each in running:
            try:
                each.proc.wait(60)
            except subprocess.TimeoutExpired:
                each.proc.kill()
                each.proc.wait()


def wait_ready(running: list[Running], *, timeout: float = 120) -> None:
    """Wait until every process answers ``/readyz`` with 200."""
    deadline = time.monotonic() + timeout
    for each in running:
        port, proc = each.port, each.proc
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the process with metrics port {port} exited with {proc.returncode} "
                    f"(see its log {each.log})"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the process with metrics port {port} never got ready (see its log {each.log})"
                )
            time.sleep(0.2)


def metric(running: Running, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` on a process's ``/metrics`` (0 if absent)."""
    url = f"http://127.0.0.1:{running.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident set size now, its peak so far) of process ``pid`` in MiB: ``VmRSS`` and
    ``VmHWM`` of ``/proc/<pid>/status``."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss, peak = (int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))
    return round(rss, 1), round(peak, 1)


def wait_shards_shared(bench: Bench, owners: int, *, timeout: float = 120) -> None:
    """Wait until ``owners`` relays hold every shard between them, evenly (one apart at most)."""
    deadline = time.monotonic() + timeout
    while True:
        with bench.engine.connect() as conn:
            total = int(
                conn.execute(sa.text("SELECT count(*) FROM oncely_relay_shards")).scalar_one()
            )
            held = [
                int(n)
                for n in conn.execute(
                    sa.text(
                        "SELECT count(*) FROM oncely_relay_shards"
                        " WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner"
                    )
                ).scalars()
            ]
        if len(held) == owners and sum(held) == total and max(held) - min(held) <= 1:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{owners} relay(s) never shared the {total} shards: {held}")
        time.sleep(0.2)


@contextlib.contextmanager
def relay_processes(
    bench: Bench, count: int = 1, *, env: dict[str, str] | None = None
) -> Iterator[list[Running]]:
    """``count`` ``oncely relay run`` processes, ready and sharing the shards evenly (``env``
    over :meth:`Bench.relay_env`)."""
    with processes(["relay", "run"], count, {**bench.relay_env(), **(env or {})}) as running:
        wait_ready(running)
        wait_shards_shared(bench, count)
        yield running


@contextmanager
def relays(bench: Bench, count: int = 1) -> Iterator[list[object]]:
    """``count`` relays on threads for the duration of the block (the consumer cells' pipeline)."""
    stop = threading.Event()
    running = [
        build_relay(
            engine=bench.engine,
            kafka=KafkaSettings(bootstrap_servers=bench.bootstrap),
            settings=bench.relay_settings(),
            stop=stop,
            metrics=RelayMetrics(),
        )
        for _ in range(count)
    ]
    threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in running]
    for thread in threads:
        thread.start()
    try:
        yield list(running)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


# -- topics and measurements -----------------------------------------------------------------


class Topics:
    """Fresh ``LogAppendTime`` topics for a cell's turns, and how many records they hold.

    Every record's timestamp is the broker's append time, so times from every side are on one
    clock (the host's: writers take ``time.time()`` on the same machine).
    """

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.admin = bench.admin()
        self.created: list[str] = []
        self.consumer = Consumer(
            {
                "bootstrap.servers": bench.bootstrap,
                "group.id": f"bench-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
            }
        )

    def new(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        topic = NewTopic(
            name,
            num_partitions=self.bench.partitions,
            config={"message.timestamp.type": "LogAppendTime"},
        )
        self.admin.create_topics([topic])[name].result(30)
        self.created.append(name)
        return name

    def count(self, topic: str) -> int:
        return sum(
            self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(self.bench.partitions)
        )

    def wait(self, topic: str, total: int, *, timeout: float) -> bool:
        """Wait until ``topic`` holds ``total`` records; whether it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.count(topic) < total:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def append_times(self, topic: str) -> dict[str, float]:
        """Every record's broker append time (epoch ms) by its ``id`` header (the first copy)."""
        total = self.count(topic)
        self.consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(self.bench.partitions)]
        )
        times: dict[str, float] = {}
        seen, deadline = 0, time.monotonic() + 120
        while seen < total and time.monotonic() < deadline:
            for message in self.consumer.consume(1000, 0.5):
                if message.error() is not None:
                    continue
                seen += 1
                kind, stamp = message.timestamp()
                assert kind == TIMESTAMP_LOG_APPEND_TIME, f"{topic} is not LogAppendTime"
                event_id = dict(message.headers() or []).get("id")
                if isinstance(event_id, bytes):
                    times.setdefault(event_id.decode(), float(stamp))
        self.consumer.unassign()
        return times

    def close(self) -> None:
        self.consumer.close()
        if self.created:
            for future in self.admin.delete_topics(self.created).values():
                with contextlib.suppress(Exception):
                    future.result(30)


@dataclass
class Seen:
    """What a ``read_committed`` reader of one topic saw: for each record (by its ``id``
    header, the first copy) the wall-clock time it was first returned, its broker append time
    (epoch seconds); and how many records it returned in all (copies too)."""

    at: dict[str, tuple[float, float]] = field(default_factory=dict)
    records: int = 0

    def wait(self, count: int, *, timeout: float) -> bool:
        """Wait until ``count`` distinct records were seen; whether they were within ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(self.at) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def appended(self) -> dict[str, float]:
        """Every record's broker append time (epoch ms) by its ``id``, as
        :meth:`Topics.append_times` gives it."""
        return {event_id: stamp * 1000 for event_id, (_, stamp) in self.at.items()}


@contextmanager
def read_committed(bench: Bench, topic: str) -> Iterator[Seen]:
    """A ``read_committed`` consumer of ``topic`` (a :class:`Topics` topic) on a thread of its
    own for the block, from the beginning: a record of an open transaction is returned once the
    transaction commits (never, if it aborts), so what it saw is what any ``read_committed``
    consumer could see, and when. It fetches with ``fetch.wait.max.ms=10``; the watermarks of
    :meth:`Topics.count` cannot stand in for it (they count transaction markers and aborted
    records)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bench.bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 10,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(bench.partitions)])
    seen, stop = Seen(), threading.Event()

    def run() -> None:
        while not stop.is_set():
            messages = consumer.consume(1000, 0.05)
            now = time.time()
            for message in messages:
                if message.error() is not None:
                    continue
                seen.records += 1
                event_id = dict(message.headers() or []).get("id")
                if isinstance(event_id, bytes) and event_id.decode() not in seen.at:
                    stamp = message.timestamp()[1] / 1000
                    seen.at[event_id.decode()] = (now, stamp)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)
        consumer.close()


def sentinel(bench: Bench, topics: Topics, topic: str) -> None:
    """One row through the running side, so it is reading (or streaming) before any timing."""
    [row] = staged_rows(1, topic=topic, keys=1)
    with bench.engine.begin() as conn:
        conn.execute(sa.insert(outbox), {**row, "aggregateid": "sentinel"})
    if not topics.wait(topic, 1, timeout=120):
        raise TimeoutError(f"the sentinel row never reached {topic}")


def drain_rate(
    bench: Bench,
    topics: Topics,
    side: Side,
    rows: list[dict[str, object]],
    *,
    visible: bool = False,
) -> float:
    """Rows/s from the commit of ``rows`` (one transaction) to the append of the last of them,
    with ``side`` already running (steady state, not start-up); with ``visible``, to the moment
    a ``read_committed`` consumer (:func:`read_committed`) has seen every one of them."""
    topic = topics.new()
    restage(bench, [])
    with side():
        sentinel(bench, topics, topic)
        if visible:
            with read_committed(bench, topic) as seen:
                committed = commit_at_once(bench, rows, topic)
                with cpu_window():
                    if not seen.wait(len(rows) + 1, timeout=600):
                        raise TimeoutError(f"only {len(seen.at) - 1} of {len(rows)} rows visible")
            return len(rows) / (max(at for at, _ in seen.at.values()) - committed)
        committed = commit_at_once(bench, rows, topic)
        with cpu_window():  # from the commit to the last record: the drain alone
            if not topics.wait(topic, len(rows) + 1, timeout=600):
                raise TimeoutError(f"only {topics.count(topic) - 1} of {len(rows)} rows published")
    last = max(topics.append_times(topic).values())
    return len(rows) / (last / 1000 - committed)


@dataclass
class Writes:
    """When each open-loop write was due and when its transaction had committed (wall clock).

    ``run(rate, seconds)`` writes every row open loop (event ``i`` due at ``t0 + i / rate``);
    ``backend_pids`` are the PostgreSQL backends of the writers' connections.
    """

    writers: list[Callable[[int, float], None]]
    due: list[float]
    committed: list[float] = field(default_factory=list)
    backend_pids: list[int] = field(default_factory=list)
    run: Callable[[float, float], None] = lambda rate, seconds: None

    def achieved_rate(self) -> float:
        return len(self.due) / (max(self.committed) - self.due[0])


@contextmanager
def outbox_writers(
    database_url: str,
    rows: list[dict[str, Any]],
    *,
    count: int,
    after_commit: Callable[[int], None] | None = None,
) -> Iterator[Writes]:
    """``count`` writers for :func:`bench.harness.open_loop`: ``writer(i, due)`` commits
    ``rows[i]`` as a one-row transaction, then calls ``after_commit(i)`` when given.

    Each writer has its own autocommit connection and one prepared INSERT (one round trip per
    transaction), so that the writers limit the offered load as little as Python can.
    """
    insert = _insert(rows[0])
    writes = Writes([], [0.0] * len(rows), [0.0] * len(rows))
    connections = [psycopg.connect(libpq_dsn(database_url), autocommit=True) for _ in range(count)]
    writes.backend_pids = [conn.info.backend_pid for conn in connections]

    def writer(conn: psycopg.Connection[Any]) -> Callable[[int, float], None]:
        def write(i: int, due_at: float) -> None:
            writes.due[i] = due_at
            conn.execute(insert, _values(rows[i]), prepare=True)
            writes.committed[i] = time.time()
            if after_commit is not None:
                after_commit(i)

        return write

    writes.writers = [writer(conn) for conn in connections]
    writes.run = lambda rate, seconds: open_loop(rate, seconds, writes.writers)
    try:
        yield writes
    finally:
        for conn in connections:
            conn.close()


def _insert(row: dict[str, Any]) -> str:
    columns = list(row)
    return (
        f"INSERT INTO oncely_outbox ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))})"
    )


def _values(row: dict[str, Any]) -> list[Any]:
    return [Jsonb(v) if c == "headers" else v for c, v in row.items()]


def _write_share(
    database_url: str,
    share: list[tuple[int, dict[str, Any]]],
    threads: int,
    pipe: Any,
) -> None:
    """One writer process of :func:`process_writers`: ``threads`` connections, each committing
    its part of ``share`` open loop once told ``(t0, rate)``; sends back
    ``[(i, due, committed), ...]``."""
    connections = [
        psycopg.connect(libpq_dsn(database_url), autocommit=True) for _ in range(threads)
    ]
    insert = _insert(share[0][1]) if share else ""
    pipe.send([conn.info.backend_pid for conn in connections])
    t0, rate = pipe.recv()
    done: list[tuple[int, float, float]] = []

    def run(conn: psycopg.Connection[Any], mine: list[tuple[int, dict[str, Any]]]) -> None:
        for i, row in mine:
            due_at = t0 + i / rate
            delay = due_at - time.time()
            if delay > 0:
                time.sleep(delay)
            conn.execute(insert, _values(row), prepare=True)
            done.append((i, due_at, time.time()))

    workers = [
        threading.Thread(target=run, args=(conn, share[j::threads]))
        for j, conn in enumerate(connections)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    pipe.send(done)
    for conn in connections:
        conn.close()
    # Alive until the block of process_writers ends, so that a CPU window around it counts it.
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()


@contextmanager
def process_writers(
    database_url: str, rows: list[dict[str, Any]], *, processes: int, threads: int
) -> Iterator[Writes]:
    """Like :func:`outbox_writers`, from ``processes`` writer processes (spawned, so that the
    writers are not held back by this process's GIL), each with ``threads`` threads, each with
    its own autocommit connection and one prepared INSERT. Row ``i`` goes to process
    ``i % processes``; every process takes its due times from one ``t0`` on the wall clock.
    """
    context = multiprocessing.get_context("spawn")
    pipes, children = [], []
    try:
        for k in range(processes):
            mine, theirs = context.Pipe()
            share = [(i, rows[i]) for i in range(k, len(rows), processes)]
            child = context.Process(
                target=_write_share, args=(database_url, share, threads, theirs), daemon=True
            )
            child.start()
            theirs.close()
            pipes.append(mine)
            children.append(child)
        writes = Writes([], [0.0] * len(rows), [0.0] * len(rows))
        for pipe in pipes:
            writes.backend_pids += pipe.recv()

        def run(rate: float, seconds: float) -> None:
            t0 = time.time() + 0.3
            for pipe in pipes:
                pipe.send((t0, rate))
            for pipe in pipes:
                for i, due_at, committed_at in pipe.recv():
                    writes.due[i], writes.committed[i] = due_at, committed_at

        writes.run = run
        yield writes
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99 of ``values`` (ms), inclusive quantiles, and the largest."""
    if len(values) < 2:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "max": float("nan")}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "p50": round(q[49], 1),
        "p95": round(q[94], 1),
        "p99": round(q[98], 1),
        "max": round(max(values), 1),
    }


def commit_latency(
    bench: Bench,
    topics: Topics,
    side: Side,
    rate: float,
    seconds: float,
    *,
    writers: int,
    warmup_seconds: float,
    produce: Callable[[str], Callable[[dict[str, Any]], None]] | None = None,
    writer_processes: int = 0,
    idle_seconds: float = 0.0,
    visible: bool = False,
) -> dict[str, Any]:
    """commit → Kafka (and schedule → Kafka) percentiles of open-loop single-row transactions
    at ``rate`` for ``seconds``, with ``side`` running.

    With ``produce`` (given the topic, it returns a function of a row), each writer also sends
    its row itself right after its commit (a raw producer beside the outbox). Events due in the
    first ``warmup_seconds`` are left out. With ``writer_processes``, the ``writers`` threads
    are in each of that many processes of their own (:func:`process_writers`; not with
    ``produce``). With ``idle_seconds``, a CPU window of that long with nothing written is
    measured once the side runs, just before the writes (``cpu["idle"]``).

    With ``visible``, a :func:`read_committed` consumer reads the topic during the writes, and
    ``commit_to_visible_ms`` is added: from each commit to the moment it returned the record.

    ``cpu`` holds cores by process class over the writes (``load``, from the first write to the
    last record), over the idle window (``idle``), the writers' PostgreSQL backends' share of
    ``load`` (``writer_backends``), the windows' seconds and the CPU idle share of ``load``.
    """
    topic = topics.new()
    rows = staged_rows(int(rate * seconds), topic=topic, keys=bench.keys)
    restage(bench, [])
    send = produce(topic) if produce is not None else None
    after = (lambda i: send(rows[i])) if send is not None else None
    if writer_processes:
        assert send is None, "a raw producer beside the outbox needs the writers in this process"
        writing = process_writers(
            bench.database_url, rows, processes=writer_processes, threads=writers
        )
    else:
        writing = outbox_writers(bench.database_url, rows, count=writers, after_commit=after)
    idle = Window()
    total = len(rows) + (1 if send is None else 0)
    with writing as writes, side(), contextlib.ExitStack() as reading:
        if send is None:
            sentinel(bench, topics, topic)
        seen = reading.enter_context(read_committed(bench, topic)) if visible else None
        if idle_seconds:
            with cpu_window() as idle:
                time.sleep(idle_seconds)
        with cpu_window() as load:
            writes.run(rate, seconds)
            if seen is None:
                topics.wait(topic, total, timeout=120)
            else:
                seen.wait(total, timeout=120)
    due, committed = writes.due, writes.committed
    appended = topics.append_times(topic) if seen is None else seen.appended()
    measured_from = due[0] + warmup_seconds
    commit_ms, schedule_ms, lag_ms, visible_ms, missing = [], [], [], [], 0
    for row, due_at, committed_at in zip(rows, due, committed, strict=True):
        if due_at < measured_from:
            continue
        stamp = appended.get(str(row["id"]))
        if stamp is None:
            missing += 1
            continue
        commit_ms.append(stamp - committed_at * 1000)
        schedule_ms.append(stamp - due_at * 1000)
        lag_ms.append((committed_at - due_at) * 1000)
        if seen is not None:
            visible_ms.append((seen.at[str(row["id"])][0] - committed_at) * 1000)
    return {
        **({"commit_to_visible_ms": percentiles(visible_ms)} if seen is not None else {}),
        "commit_to_kafka_ms": percentiles(commit_ms),
        "schedule_to_kafka_ms": percentiles(schedule_ms),
        "writer_lag_ms": percentiles(lag_ms),
        "achieved_rate_per_second": round(writes.achieved_rate(), 1),
        "events_measured": len(commit_ms),
        "missing": missing,
        "cpu": {
            "load": {kind: round(v, 4) for kind, v in sorted(load.cores.items())},
            "load_seconds": round(load.seconds, 2),
            "load_idle_share": round(load.idle, 3),
            "writer_backends": round(
                sum(load.by_pid.get(pid, ("", 0.0))[1] for pid in writes.backend_pids), 4
            ),
            "idle": {kind: round(v, 4) for kind, v in sorted(idle.cores.items())},
            "idle_seconds": round(idle.seconds, 2),
        },
    }
