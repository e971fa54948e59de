"""The suite is hermetic: a stack that ``oncely dev up`` runs in its default folder, and the
developer's own ``ONCELY_*`` settings, change no test (tests/conftest.py sets the environment)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from oncely.cli import app
from oncely.cli._errors import run
from oncely.devstack.jvm import cache_root
from oncely.devstack.stack import StackInfo, default_stack_dir, write_state
from tests.conftest import INHERITED
from tests.helpers import oncely_process, process_environment, run_captured

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_sees_neither_the_developers_stack_nor_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert {n for n in os.environ if n.startswith("ONCELY_")} <= INHERITED | {
        "ONCELY_CACHE_DIR",
        "ONCELY_DEVSTACK_DIR",
    }
    home_cache = Path.home() / ".cache"
    assert not default_stack_dir().is_relative_to(home_cache)
    assert not cache_root().is_relative_to(home_cache)
    assert run(app, ["dev", "status", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"running": False}
    # The CLI in a subprocess, as the acceptance tests run it.
    child = oncely_process("dev", "status", "--json", timeout=60)
    assert child.returncode == 1, child.stderr
    assert json.loads(child.stdout) == {"running": False}


def _fake_running_stack(directory: Path) -> None:
    """A ``state.json`` as ``oncely dev up`` writes it, whose supervisor (this process) runs."""
    nowhere = "127.0.0.1:1"
    directory.mkdir(parents=True)
    write_state(
        directory,
        StackInfo(
            kafka_bootstrap=nowhere,
            kafka_version="4.4.0",
            database_url=f"postgresql+psycopg://developer@{nowhere}/devstack",
            postgres_version="18",
            supervisor_pid=os.getpid(),
            kafka_pid=os.getpid(),
            postgres_pid=os.getpid(),
            kafka_log=str(directory / "kafka.log"),
            postgres_log=str(directory / "postgres.log"),
        ),
    )


@pytest.mark.slow  # starts a devstack and a pytest process
@pytest.mark.timeout(300)
def test_a_stack_running_in_the_default_folder_changes_no_test(tmp_path: Path) -> None:
    """The suite's bad-input tests and the check above, run by pytest as a developer would run
    them: with a stack up in the default folder and its settings exported in the shell."""
    home = tmp_path / "home"
    stack = home / ".cache" / "oncely" / "devstack"
    _fake_running_stack(stack)
    exported = {
        "HOME": str(home),
        "ONCELY_DATABASE_URL": "postgresql+psycopg://developer@127.0.0.1:1/devstack",
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "ONCELY_RELAY_BATCH_SIZE": "5",
    }
    # Not the suite's: no ONCELY_* of its own, no cache or pytest options of its own.
    unset = ["ONCELY_", "XDG_CACHE_HOME", "PYTEST_ADDOPTS"]
    shell = process_environment(exported, without=unset)
    # The developer's shell does see the stack (else this test would prove nothing).
    seen = oncely_process("dev", "status", "--json", env=exported, without=unset, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout)["supervisor_pid"] == os.getpid()
    suite = run_captured(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            # Not the one that waits 10 s for a broker: the others meet the same settings.
            *("-m", "not slow"),
            "tests/unit/test_cli_errors.py",
            f"{Path(__file__).relative_to(ROOT)}::"
            "test_the_suite_sees_neither_the_developers_stack_nor_settings",
        ],
        cwd=ROOT,
        env=shell,
        timeout=280,
    )
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert (stack / "state.json").exists(), "the suite left the developer's stack alone"
