"""`oncely dev up|status|down` in subprocesses, the way a developer runs them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from oncely.testing.services import libpq_dsn
from tests.helpers import oncely_process, start_oncely

pytestmark = pytest.mark.acceptance


def _up(directory: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    proc = start_oncely("dev", "up", "--dir", str(directory), stdout=subprocess.PIPE)
    exports: dict[str, str] = {}
    assert proc.stdout is not None
    deadline = time.monotonic() + 150
    while len(exports) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        name, _, value = line.removeprefix("export ").strip().partition("=")
        exports[name] = value
    if len(exports) < 2:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"`oncely dev up` printed no settings; stderr:\n{stderr}")
    return proc, exports


def _check_reachable(exports: dict[str, str]) -> None:
    admin = AdminClient({"bootstrap.servers": exports["ONCELY_KAFKA_BOOTSTRAP_SERVERS"]})
    assert admin.list_topics(timeout=10).brokers
    with psycopg.connect(libpq_dsn(exports["ONCELY_DATABASE_URL"])) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_dev_up_down_and_up_again(tmp_path: Path) -> None:
    directory = tmp_path / "stack"
    for _round in range(2):
        proc, exports = _up(directory)
        try:
            _check_reachable(exports)
            status = oncely_process("dev", "status", "--dir", str(directory))
            assert status.returncode == 0, status.stderr
            assert exports["ONCELY_KAFKA_BOOTSTRAP_SERVERS"] in status.stdout
            again = oncely_process("dev", "up", "--dir", str(directory))
            assert again.returncode == 1
            assert "already runs" in again.stderr
        finally:
            down = oncely_process("dev", "down", "--dir", str(directory))
        assert down.returncode == 0, down.stderr
        assert "stopped Kafka" in down.stdout
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        assert not directory.exists(), "dev down leaves no data behind"
        stopped = oncely_process("dev", "status", "--dir", str(directory))
        assert stopped.returncode == 1
        assert "no stack runs" in stopped.stdout
