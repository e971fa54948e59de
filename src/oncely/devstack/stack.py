"""The whole local stack (one Kafka broker + one PostgreSQL) and its on-disk state.

``DevStack`` is used in-process (tests, the demo) as a context manager. ``oncely dev up`` runs
one in the foreground and records it in ``state.json`` inside the stack folder, which is how
``oncely dev status`` and ``oncely dev down`` find it from another shell.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from oncely.devstack._process import pid_alive
from oncely.devstack.kafka import DEFAULT_KAFKA_VERSION, KafkaNode, cache_root
from oncely.devstack.postgres import PostgresNode
from oncely.errors import DevstackError

_STATE_FILE = "state.json"


def default_stack_dir() -> Path:
    """``$ONCELY_DEVSTACK_DIR`` or ``<cache>/devstack``."""
    configured = os.environ.get("ONCELY_DEVSTACK_DIR")
    return Path(configured) if configured else cache_root() / "devstack"


@dataclass(frozen=True, kw_only=True)
class StackInfo:
    """How to reach a running stack, and what runs it."""

    kafka_bootstrap: str
    kafka_version: str
    database_url: str
    postgres_version: str
    supervisor_pid: int
    kafka_pid: int
    postgres_pid: int
    kafka_log: str
    postgres_log: str

    def exports(self) -> str:
        """Shell ``export`` lines for the oncely settings that point at this stack."""
        return (
            f"export ONCELY_KAFKA_BOOTSTRAP_SERVERS={self.kafka_bootstrap}\n"
            f"export ONCELY_DATABASE_URL={self.database_url}\n"
        )


class DevStack:
    """Start and stop one Kafka broker and one PostgreSQL under ``directory``.

    Data lives in ``directory`` (a fresh temporary folder when not given) and is deleted by
    :meth:`stop` when ``keep_data`` is false. Raises :class:`DevstackError` (or its subclass
    :class:`ToolMissingError`) when a service cannot start.
    """

    def __init__(
        self,
        *,
        directory: Path | None = None,
        kafka_version: str | None = None,
        keep_data: bool = False,
    ) -> None:
        self.directory = directory or Path(tempfile.mkdtemp(prefix="oncely-devstack-"))
        self.kafka_version = kafka_version or os.environ.get(
            "ONCELY_DEVSTACK_KAFKA_VERSION", DEFAULT_KAFKA_VERSION
        )
        self.keep_data = keep_data
        self._kafka: KafkaNode | None = None
        self._postgres: PostgresNode | None = None
        self.info: StackInfo | None = None

    def start(self) -> StackInfo:
        """Start PostgreSQL, then Kafka; on any failure stop what started and re-raise."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._postgres = PostgresNode(data_dir=self.directory / "postgres")
            self._postgres.start()
            self._kafka = KafkaNode(data_dir=self.directory / "kafka", version=self.kafka_version)
            self._kafka.start()
        except BaseException:
            self.stop()
            raise
        assert self._kafka.pid is not None
        assert self._postgres.pid is not None
        self.info = StackInfo(
            kafka_bootstrap=self._kafka.bootstrap_servers,
            kafka_version=self._kafka.logged_version() or f"{self.kafka_version} (not yet logged)",
            database_url=self._postgres.url,
            postgres_version=self._postgres.server_version(),
            supervisor_pid=os.getpid(),
            kafka_pid=self._kafka.pid,
            postgres_pid=self._postgres.pid,
            kafka_log=str(self._kafka.log_file),
            postgres_log=str(self._postgres.log_file),
        )
        return self.info

    def stop(self) -> None:
        """Stop both services and, unless ``keep_data``, delete their data. Idempotent."""
        if self._kafka is not None:
            self._kafka.stop()
            self._kafka = None
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
        self.info = None
        if not self.keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> StackInfo:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def write_state(directory: Path, info: StackInfo) -> None:
    """Record a running stack so other processes can find it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _STATE_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")


def read_state(directory: Path) -> StackInfo | None:
    """The recorded stack of ``directory`` if its supervisor still runs, else ``None``."""
    try:
        data = json.loads((directory / _STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    info = StackInfo(**data)
    return info if pid_alive(info.supervisor_pid) else None


def stop_recorded(directory: Path, *, timeout: float = 60.0) -> StackInfo | None:
    """Ask the ``oncely dev up`` that runs the stack in ``directory`` to stop, and wait for it.

    Returns what was stopped, or ``None`` when nothing ran there. Raises :class:`DevstackError`
    if the supervisor does not exit within ``timeout`` seconds.
    """
    info = read_state(directory)
    if info is None:
        (directory / _STATE_FILE).unlink(missing_ok=True)
        return None
    os.kill(info.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(info.supervisor_pid):
        if time.monotonic() > deadline:
            raise DevstackError(
                f"`oncely dev up` (pid {info.supervisor_pid}) did not stop within {timeout:.0f} s"
            )
        time.sleep(0.2)
    return info
