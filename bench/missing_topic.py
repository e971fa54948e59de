"""R-MISSING-TOPIC: what a missing topic costs the others.

A service stages, 20 times a second each, one event on a topic that exists and one on a topic
that does not (deployed before ``oncely topics ensure``). An ``oncely relay run`` process, with
its default settings, publishes them. The cell measures, for the topic that exists, commit to
Kafka (the consumer's receive time minus the row's ``created_at``, which is the record's
timestamp) over the window; then it creates the missing topic and measures how long its rows
take to be published. Each side runs the relay from a source tree (``python -m bench
R-MISSING-TOPIC --side before=/tmp/oncely-before/src``, from a ``git worktree``; the default is
this checkout) on a database of its own upgraded by that tree's migrations, one side after the
other on the same broker. One run per side: its figure is the p99, reported.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench.harness import Cell
from oncely.storage import outbox
from oncely.testing.services import libpq_dsn

HERE = Path(__file__).resolve().parent.parent / "src"
RATE = 20.0


@dataclass(frozen=True)
class Result:
    side: str
    received: int
    staged: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    missing_published_after_create_s: float


def _new_database(admin_url: str) -> str:
    name = f"bench_missing_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(libpq_dsn(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return str(sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False))


def _oncely(
    src: Path, args: list[str], env: dict[str, str], **kwargs: object
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "oncely", *args],
        env={**os.environ, **env, "PYTHONPATH": str(src)},
        **kwargs,  # type: ignore[arg-type]
    )


def _row(topic: str) -> dict[str, object]:
    return {
        "id": uuid.uuid4(),
        "aggregatetype": "bench",
        "aggregateid": uuid.uuid4().hex,
        "type": "bench.event",
        "topic": topic,
        "payload": b"x" * 200,
        "headers": {},
        "event_key": uuid.uuid4().hex,
    }


def _consume(bootstrap: str, topic: str, stop: threading.Event, latencies: list[float]) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    try:
        while not stop.is_set():
            message = consumer.poll(0.05)
            if message is None or message.error() is not None:
                continue
            _, stamp = message.timestamp()
            latencies.append(time.time() * 1000 - stamp)
    finally:
        consumer.close()


def run_side(name: str, src: Path, admin_url: str, bootstrap: str, seconds: float) -> Result:
    url = _new_database(admin_url)
    env = {"ONCELY_DATABASE_URL": url, "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    assert _oncely(src, ["db", "upgrade"], env, stdout=subprocess.DEVNULL).wait(120) == 0
    admin = AdminClient({"bootstrap.servers": bootstrap})
    flowing, missing = f"bench-ok-{uuid.uuid4().hex[:8]}", f"bench-missing-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(flowing, num_partitions=2)])[flowing].result(30)
    engine = sa.create_engine(url)
    stop = threading.Event()
    latencies: list[float] = []
    reader = threading.Thread(target=_consume, args=(bootstrap, flowing, stop, latencies))
    reader.start()
    log = (Path(tempfile.gettempdir()) / f"bench-missing-{name}.log").open("wb")
    relay = _oncely(src, ["relay", "run"], env, stdout=log, stderr=subprocess.STDOUT)
    staged = 0
    try:
        time.sleep(5)  # the relay starts and takes its shards
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            with engine.begin() as conn:
                conn.execute(sa.insert(outbox), [_row(flowing), _row(missing)])
            staged += 1
            time.sleep(max(0.0, start + staged / RATE - time.monotonic()))
        time.sleep(3)
        stop.set()
        reader.join()
        created = time.monotonic()
        admin.create_topics([NewTopic(missing, num_partitions=2)])[missing].result(30)
        on_kafka = 0
        while on_kafka < staged and time.monotonic() - created < 300:
            time.sleep(0.5)
            on_kafka = _high_watermarks(bootstrap, missing)
        resumed = time.monotonic() - created
    finally:
        relay.terminate()
        relay.wait(60)
        log.close()
        engine.dispose()
        admin.delete_topics([flowing, missing])
    ordered = sorted(latencies)
    return Result(
        side=name,
        received=len(ordered),
        staged=staged,
        p50_ms=statistics.median(ordered) if ordered else float("nan"),
        p99_ms=ordered[int(0.99 * (len(ordered) - 1))] if ordered else float("nan"),
        max_ms=ordered[-1] if ordered else float("nan"),
        missing_published_after_create_s=resumed,
    )


def _high_watermarks(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"wm-{uuid.uuid4().hex}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        )
    finally:
        consumer.close()


def missing_topic_cells(
    sides: list[tuple[str, Path]], *, admin_url: str, bootstrap: str, seconds: float
) -> tuple[list[Cell], list[dict[str, Any]]]:
    """One absolute cell per side (its p99, named after the side when there are several), and
    every side's figures."""
    made, details = [], []
    for name, src in sides:
        result = run_side(name, src, admin_url, bootstrap, seconds)
        details.append(asdict(result))
        cell = Cell(
            "R-MISSING-TOPIC p99" + (f" ({name})" if len(sides) > 1 else ""),
            f"{name}: the existing topic's commit-to-Kafka p99",
            [],
            "ms",
            target="reported",
            measures=f"commit-to-Kafka p99 of a topic that exists, {RATE:.0f} events/s, while "
            f"another topic's rows ({RATE:.0f}/s) wait for their topic; relay from {src}",
            summary=f"p50/p99/max {result.p50_ms:.1f}/{result.p99_ms:.1f}/{result.max_ms:.1f} "
            f"ms; received {result.received} of {result.staged} staged; the missing topic's "
            f"rows on Kafka {result.missing_published_after_create_s:.1f} s after its creation",
            notes=[f"one run of {seconds:.0f} s"],
        )
        cell.rates = {cell.numerator: [result.p99_ms]}
        made.append(cell)
    return made, details
