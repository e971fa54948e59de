"""`oncely demo` end to end (small): separate processes, faults, invariants from the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.acceptance


def _demo(database_url: str, bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "COLUMNS": "160",
    }
    return subprocess.run(
        [sys.executable, "-m", "oncely", "demo", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
        check=False,
    )


@pytest.mark.timeout(450)
def test_the_demo_survives_its_faults_with_every_invariant_green(
    new_database: Callable[..., str], kafka_bootstrap: str
) -> None:
    result = _demo(new_database(), kafka_bootstrap, "--events", "400")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "✘" not in out
    assert re.search(r"transfers requested\s+│ 400 \(\+\d+ retried with the same key\)", out)
    assert re.search(r"events committed\s+│ 800 ", out), "two events per transfer, from this run"
    assert re.search(r"lost \(committed, not in Kafka\)\s+│ 0 ", out)
    assert re.search(r"duplicate effects\s+│ 0 ", out)
    assert "relay killed with SIGKILL mid-run" in out
    assert "ledger-projection replayed to earliest" in out
