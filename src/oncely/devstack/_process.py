"""Child processes of the devstack: free ports, tools run to completion, parent-death signals,
bounded stops, log tails."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oncely.errors import DevstackError

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports from :func:`free_port` (two calls can return the same port)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def run_tool(args: Sequence[str], *, doing: str, **options: Any) -> None:
    """Run a command to completion; raise :class:`DevstackError` saying it failed ``doing``
    what, with its exit status and the end of its output, when it exits non-zero. ``options``
    go to :func:`subprocess.run`."""
    result = subprocess.run(args, capture_output=True, text=True, check=False, **options)
    if result.returncode != 0:
        raise DevstackError(
            f"{doing} failed (exit {result.returncode}):\n"
            + (result.stdout + result.stderr)[-4000:]
        )


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies (Linux).

    A test run or ``oncely dev up`` killed with SIGKILL then leaves no broker or database behind.
    """

    def _preexec() -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig))

    return _preexec


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals, timeout: float) -> int:
    """Send ``sig``, wait up to ``timeout`` seconds, then SIGKILL; return the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (and is not a zombie we could reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return status.read_text().split(") ", 1)[1][0] != "Z"
    return True


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, or a note that there is none."""
    try:
        with path.open(errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except FileNotFoundError:
        return f"(no log at {path})"
