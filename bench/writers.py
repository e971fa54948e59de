"""Open-loop outbox writers in a process of their own (R4, R4-quiet).

``python -m bench.writers SPEC`` where ``SPEC`` is a JSON object: ``database_url``,
``topic_prefix`` (the :mod:`bench.effects_app` app's), ``rate`` (events/s), ``seconds``,
``writers`` (threads, each with its own autocommit connection and one prepared INSERT),
``processes`` (optional, default 1: with more, the threads are in each of that many spawned
processes, :func:`bench.fixtures.process_writers`, so that one GIL does not hold them back),
``keys`` and ``out`` (a file path). It builds the rows (``credited`` events, Avro, ``keys``
keys) and connects, prints ``ready``, waits for a line on stdin, then commits one row per
transaction open loop (:func:`bench.harness.open_loop`: event ``i`` due at ``t0 + i / rate``)
and writes to ``out`` a JSON object ``{"ids": [...], "due": [...], "committed": [...]}``: per
event index, its event id, when it was due and when its commit returned (``time.time()``, the
host clock the receipts' ``applied_at`` is compared with).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka.admin import NewTopic

from bench.effects_app import build_effects, create_effects_table
from bench.fixtures import Bench, outbox_writers, process_writers
from oncely.schemas.codec import Codec


def outbox_rows(topic_prefix: str, count: int, *, keys: int) -> list[dict[str, Any]]:
    """``count`` outbox rows of the app's ``credited`` event over ``keys`` keys, as
    ``stage()`` writes them (Avro value, content-type and schema-version headers)."""
    app = build_effects(topic_prefix, "")
    [event_type] = app.get("apply").event_types
    codec = Codec(registry=app.registry)
    rows = []
    for i in range(count):
        account = f"acc-{i % keys}"
        value, headers = codec.encode(event_type.model(account=account, amount=i))
        rows.append(
            {
                "id": uuid.uuid4(),
                "aggregatetype": "account",
                "aggregateid": account,
                "type": "credited",
                "topic": event_type.topic,
                "payload": value,
                "headers": headers,
                "event_key": uuid.uuid4().hex,
            }
        )
    return rows


def effects_topic(bench: Bench, topic_prefix: str) -> str:
    """The effects app's topic under ``topic_prefix``, created with ``bench.partitions``
    partitions, and the effects table; returns the topic."""
    topic = str(outbox_rows(topic_prefix, 1, keys=1)[0]["topic"])
    admin = bench.admin()  # kept alive until the topic exists
    admin.create_topics([NewTopic(topic, num_partitions=bench.partitions)])[topic].result(30)
    create_effects_table(bench.engine)
    return topic


def main() -> None:
    spec = json.loads(sys.argv[1])
    rate, seconds = float(spec["rate"]), float(spec["seconds"])
    rows = outbox_rows(spec["topic_prefix"], int(rate * seconds), keys=int(spec["keys"]))
    processes, threads = int(spec.get("processes", 1)), int(spec["writers"])
    writers = (
        process_writers(spec["database_url"], rows, processes=processes, threads=threads)
        if processes > 1
        else outbox_writers(spec["database_url"], rows, count=threads)
    )
    with writers as writes:
        print("ready", flush=True)
        sys.stdin.readline()
        writes.run(rate, seconds)
        Path(spec["out"]).write_text(
            json.dumps(
                {
                    "ids": [str(row["id"]) for row in rows],
                    "due": writes.due,
                    "committed": writes.committed,
                }
            )
        )
        # Alive until told (writer processes too), so that the caller's CPU window counts them.
        print("done", flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    main()
