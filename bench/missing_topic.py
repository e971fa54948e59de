"""``python -m bench.missing_topic [--side NAME=SRC ...]``: what a missing topic costs the others.

A service stages, 20 times a second each, one event on a topic that exists and one on a topic
that does not (deployed before ``oncely topics ensure``). An ``oncely relay run`` process, with
its default settings, publishes them. The script measures, for the topic that exists, commit to
Kafka (the consumer's receive time minus the row's ``created_at``, which is the record's
timestamp) over the window; then it creates the missing topic and measures how long its rows
take to be published. Each ``--side`` runs the relay from another source tree (``NAME=SRC``,
e.g. ``before=/tmp/oncely-before/src`` from a ``git worktree``) on a database upgraded by that
tree's own migrations, one after the other on the same broker; the default is this checkout.

Runs against the devstack unless ``ONCELY_DATABASE_URL`` and ``ONCELY_KAFKA_BOOTSTRAP_SERVERS``
name other services. Prints one Markdown table row per side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.devstack import DevStack
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


@contextmanager
def _services() -> Iterator[tuple[str, str]]:
    url, kafka = (
        os.environ.get("ONCELY_DATABASE_URL"),
        os.environ.get("ONCELY_KAFKA_BOOTSTRAP_SERVERS"),
    )
    if url and kafka:
        yield url, kafka
        return
    stack = DevStack()
    info = stack.start()
    try:
        yield info.database_url, info.kafka_bootstrap
    finally:
        stack.stop()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", default=[], help="NAME=SRC (repeatable)")
    parser.add_argument("--seconds", type=float, default=90.0, help="staging window per side")
    args = parser.parse_args()
    sides = [tuple(s.split("=", 1)) for s in args.side] or [("this", str(HERE))]
    results = []
    with _services() as (admin_url, bootstrap):
        for name, src in sides:
            results.append(run_side(name, Path(src), admin_url, bootstrap, args.seconds))
            print(results[-1], flush=True)
    print()
    print(
        "| side | other topic's rows received / staged | p50 ms | p99 ms | max ms "
        "| missing topic's rows all on Kafka after its creation (s) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.side} | {r.received} / {r.staged} | {r.p50_ms:.1f} | {r.p99_ms:.1f} | "
            f"{r.max_ms:.1f} | {r.missing_published_after_create_s:.1f} |"
        )


if __name__ == "__main__":
    main()
