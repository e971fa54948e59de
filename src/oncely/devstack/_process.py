"""Child processes of the devstack: free ports, tools run to completion, parent-death signals,
bounded stops, log tails, the server process every service runs as, and the ``with`` block that
stops what it started."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

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


class ServerProcess(ABC):
    """A server run as a child process of ours on 127.0.0.1.

    :meth:`_launch` starts it with its output appended to :attr:`_output_file` (it gets
    :attr:`stop_signal` if its parent dies); :meth:`_wait_until` waits for it to be ready;
    :meth:`stop` stops it with :attr:`stop_signal`, then SIGKILL after a bound. Subclasses name
    the server for messages (:attr:`title`) and say where it logs (:attr:`log_file`).
    """

    #: The server in messages: "the Kafka broker", "PostgreSQL".
    title: ClassVar[str]
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM
    #: Seconds between two readiness checks in :meth:`_wait_until`.
    poll_interval: ClassVar[float] = 0.3

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    @abstractmethod
    def log_file(self) -> Path:
        """The server's own log."""

    @property
    def _output_file(self) -> Path:
        """Where the process's stdout and stderr go: :attr:`log_file`, unless the server writes
        its log itself (then error messages end with this file's last lines too)."""
        return self.log_file

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _launch(self, command: Sequence[str], **options: Any) -> None:
        """Start ``command``; ``options`` go to :class:`subprocess.Popen`."""
        with self._output_file.open("ab") as output:
            self._proc = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(self.stop_signal),
                **options,
            )

    def _wait_until(self, ready: Callable[[], bool], *, timeout: float, unready: str) -> None:
        """Ask ``ready`` every :attr:`poll_interval` seconds until it answers true.

        Raises :class:`DevstackError` with the end of the log when the server exits first, or,
        having stopped it, when ``timeout`` seconds pass (``unready`` begins that message:
        "PostgreSQL did not accept connections on 127.0.0.1:5432").
        """
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive("during start-up")
            if ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise DevstackError(
                    f"{unready} within {timeout:.0f} s; last lines of {self.log_file}:\n"
                    f"{tail(self.log_file)}"
                )
            time.sleep(self.poll_interval)

    def _check_alive(self, when: str) -> None:
        """Raise :class:`DevstackError` with the end of the log if the server has exited."""
        assert self._proc is not None, f"{self.title} was not started"
        if self._proc.poll() is not None:
            output = self._output_file
            raise DevstackError(
                f"{self.title} exited with code {self._proc.returncode} {when}; last lines of "
                f"{self.log_file}:\n{tail(self.log_file)}"
                f"{tail(output, 15) if output != self.log_file else ''}"
            )

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop the server (:attr:`stop_signal`, then SIGKILL after ``timeout`` seconds).
        Idempotent."""
        self._stop(self.stop_signal, timeout)

    def _stop(self, sig: signal.Signals, timeout: float) -> None:
        if self._proc is not None:
            stop_process(self._proc, sig, timeout)
            self._proc = None


class StoppedOnExit(ABC):
    """Something started that :meth:`stop` ends: leaving a ``with`` block over it stops it,
    whether the block raised or not (an exception goes on)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop what was started; idempotent."""

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
