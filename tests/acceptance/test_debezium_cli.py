"""`oncely dev connect` in a subprocess: Debezium relays the outbox until SIGTERM, then the
replication slot is dropped."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from oncely.debezium import slot_status
from tests.helpers import insert_rows, outbox_rows, read_topics, start_oncely

pytestmark = [pytest.mark.acceptance, pytest.mark.debezium]


@pytest.mark.timeout(600)  # the first run resolves Kafka Connect and Debezium with Maven
def test_dev_connect_relays_the_outbox_and_drops_its_slot_on_sigterm(
    database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = new_topic(partitions=3)
    engine = sa.create_engine(database_url)
    rows = outbox_rows(6, topics=[topic], keys=3)
    insert_rows(engine, rows[:3])  # before the connector: its snapshot publishes them
    slot = f"cli_{uuid.uuid4().hex[:12]}"
    proc = start_oncely(
        *("dev", "connect", "--dir", str(tmp_path / "no-stack")),
        *("--database-url", database_url, "--bootstrap-servers", kafka_bootstrap),
        *("--slot-name", slot, "--publication-name", slot),
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("Kafka Connect REST API: http://127.0.0.1:"):
            proc.kill()
            pytest.fail(f"`oncely dev connect` did not start: {line}{proc.communicate()[1]}")
        insert_rows(engine, rows[3:])  # streamed from the WAL
        deadline = time.monotonic() + 60
        while len(records := read_topics(kafka_bootstrap, [topic])) < len(rows):
            assert time.monotonic() < deadline, f"{len(records)} of {len(rows)} records"
            time.sleep(0.5)
        assert sorted(r.headers["id"].decode() for r in records) == sorted(
            str(row["id"]) for row in rows
        )
        status = slot_status(engine, slot)
        assert status is not None
        assert status["active"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert slot_status(engine, slot) is None
    engine.dispose()
