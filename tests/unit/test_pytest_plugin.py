"""The pytest plugin is opt-in: a project that depends on oncely sees no oncely fixture in its
own test runs until it enables ``oncely.testing``, and then only ``oncely_*`` names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = [
    "oncely_services",
    "oncely_kafka_bootstrap",
    "oncely_kafka_admin",
    "oncely_new_topic",
    "oncely_new_database",
    "oncely_database_url",
    "oncely_schema_registry_url",
]


def _fixtures(project: Path, *options: str) -> str:
    """``pytest --fixtures`` in ``project`` (its own rootdir, none of this repository's config)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--fixtures", "-p", "no:cacheprovider", *options],
        cwd=project,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def _names(listing: str) -> set[str]:
    """The fixture names of a ``pytest --fixtures`` listing (each line that starts one)."""
    return {match.group(1) for match in re.finditer(r"(?m)^(\w+)( \[|$| --)", listing)}


@pytest.mark.slow  # runs pytest in processes
def test_a_project_sees_oncely_fixtures_only_once_it_opts_in(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_service.py").write_text("def test_nothing():\n    pass\n")
    without = _names(_fixtures(tmp_path))
    assert not {name for name in without if name.startswith("oncely")}, without
    assert not {"database_url", "kafka_bootstrap", "kafka_admin", "new_topic"} & without

    by_option = _fixtures(tmp_path, "-p", "oncely.testing")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["oncely.testing"]\n')
    by_conftest = _fixtures(tmp_path)
    for listing in (_names(by_option), _names(by_conftest)):
        assert set(FIXTURES) <= listing, listing
        assert not {"database_url", "kafka_bootstrap", "kafka_admin", "new_topic"} & listing
