"""Containers of the image under test, run by podman, and what the tests ask of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.images import podman_environment

ROOT = Path(__file__).resolve().parents[2]
#: The image under test: `make test-container` builds it first.
IMAGE = os.environ.get("ONCELY_TEST_IMAGE", "oncely:dev")


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    if shutil.which("podman") is None:
        raise RuntimeError("`podman` is not on PATH: run `make test-container`, which installs it")
    result = subprocess.run(
        ["podman", *args],
        env=podman_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args[:3])} ... exited {result.returncode}: {result.stderr[-2000:]}"
        )
    return result


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def wait_for(what: str, predicate: Any, timeout: float = 60, interval: float = 0.2) -> float:
    """Wait until ``predicate()`` is true; return the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
    return time.monotonic() - start


@dataclass
class Containers:
    """The containers one test starts (names under a unique prefix), removed at the end."""

    environment: dict[str, str]
    prefix: str = field(default_factory=lambda: f"oncely-test-{uuid.uuid4().hex[:8]}")
    names: list[str] = field(default_factory=list)

    def _options(self, name: str) -> list[str]:
        env = [f"--env={key}={value}" for key, value in self.environment.items()]
        return [
            f"--name={self.prefix}-{name}",
            "--network=host",  # the devstack listens on 127.0.0.1
            "--read-only",
            "--health-interval=disable",  # no systemd timer here: the tests run the check
            f"--volume={ROOT / 'examples'}:/app/examples:ro",
            *env,
        ]

    def run(
        self, name: str, *command: str, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run a one-shot command of the image to its end (removed after)."""
        return podman(
            "run", "--rm", *self._options(name), IMAGE, *command, timeout=timeout, check=False
        )

    def start(self, name: str, *command: str, extra: Sequence[str] = ()) -> str:
        """Start a long-running command of the image; return the container's name."""
        podman("run", "--detach", *self._options(name), *extra, IMAGE, *command)
        self.names.append(f"{self.prefix}-{name}")
        return f"{self.prefix}-{name}"

    def inspect(self, name: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(podman("inspect", name).stdout)
        return data[0]

    def logs(self, name: str) -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    def remove_all(self) -> None:
        for name in self.names:
            podman("rm", "--force", "--time=0", name, check=False)


def containers(environment: dict[str, str]) -> Iterator[Containers]:
    group = Containers(environment=environment)
    try:
        yield group
    finally:
        group.remove_all()
