"""The ``oncely`` command line as a process (``python -m oncely ...``), as a user runs it: to its
end (:func:`oncely_process`) or left running (:func:`start_oncely`). In this process, use
:func:`tests.helpers.oncely_cli`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: The command that runs the ``oncely`` command line of this environment.
ONCELY = (sys.executable, "-m", "oncely")


def process_environment(
    env: Mapping[str, str] | None = None, *, without: Sequence[str] = ()
) -> dict[str, str]:
    """This process's environment (the suite's, hermetic) less the variables whose names start
    with one of ``without``, then ``env`` added."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(tuple(without))}
    return {**inherited, **(env or {})}


def run_captured(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """Run the command ``argv`` to its end, its output captured as text, whatever its exit
    status; ``env`` is its whole environment (default: this process's)."""
    return subprocess.run(
        list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def oncely_process(
    *argv: str,
    env: Mapping[str, str] | None = None,
    without: Sequence[str] = (),
    cwd: Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``oncely ARGV`` as a process to its end, its output captured as text; the
    environment as :func:`process_environment` makes it."""
    return run_captured(
        [*ONCELY, *argv], env=process_environment(env, without=without), cwd=cwd, timeout=timeout
    )


def start_oncely(
    *argv: str,
    env: Mapping[str, str] | None = None,
    without: Sequence[str] = (),
    cwd: Path | None = None,
    stdout: int | IO[Any] | None = subprocess.DEVNULL,
    stderr: int | IO[Any] | None = subprocess.PIPE,
    via: Sequence[str] = (),
    interruptible: bool = False,
) -> subprocess.Popen[str]:
    """Start ``oncely ARGV`` as a process (text output; stdout dropped and stderr piped unless
    told), run by the ``via`` command if any (``opentelemetry-instrument``); the environment as
    :func:`process_environment` makes it. ``interruptible``: SIGINT stops it, as from a
    terminal (a shell's background job, as in CI, starts with SIGINT ignored)."""
    return subprocess.Popen(
        [*via, *ONCELY, *argv],
        env=process_environment(env, without=without),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
        errors="replace",
        preexec_fn=_default_sigint if interruptible else None,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
