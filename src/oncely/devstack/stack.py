"""The whole local stack (one Kafka broker or a cluster, + one PostgreSQL) and its on-disk state.

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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from oncely.devstack._process import StoppedOnExit, pid_alive
from oncely.devstack.cluster import KafkaCluster
from oncely.devstack.jvm import cache_root
from oncely.devstack.kafka import DEFAULT_KAFKA_VERSION, KafkaNode, KafkaSecurity
from oncely.devstack.postgres import PostgresNode
from oncely.errors import DevstackError

_STATE_FILE = "state.json"


def default_stack_dir() -> Path:
    """``$ONCELY_DEVSTACK_DIR`` or ``<cache>/devstack``."""
    configured = os.environ.get("ONCELY_DEVSTACK_DIR")
    return Path(configured) if configured else cache_root() / "devstack"


@dataclass(frozen=True, kw_only=True)
class KafkaNodeInfo:
    """One Kafka node of a running stack."""

    node_id: int
    bootstrap: str
    pid: int
    log: str


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
    #: The SASL_PLAINTEXT / SASL_SSL listeners, when the stack was started with kafka_security.
    kafka_sasl_bootstrap: str | None = None
    kafka_sasl_ssl_bootstrap: str | None = None
    #: Every Kafka node (one unless started with ``brokers`` > 1); ``kafka_pid`` and
    #: ``kafka_log`` are the first node's.
    kafka_nodes: tuple[KafkaNodeInfo, ...] = ()

    def exports(self) -> str:
        """Shell ``export`` lines for the oncely settings that point at this stack."""
        return (
            f"export ONCELY_KAFKA_BOOTSTRAP_SERVERS={self.kafka_bootstrap}\n"
            f"export ONCELY_DATABASE_URL={self.database_url}\n"
        )


class DevStack(StoppedOnExit):
    """Start and stop one Kafka broker and one PostgreSQL under ``directory``.

    Data lives in ``directory`` (a fresh temporary folder when not given) and is deleted by
    :meth:`stop` when ``keep_data`` is false. With ``kafka_security`` the broker also has SASL
    (SCRAM-SHA-512) listeners, and TLS if configured (see :class:`KafkaSecurity`). Raises
    :class:`DevstackError` (or its subclass :class:`~oncely.errors.ToolMissingError`) when a
    service cannot start.

    With ``brokers`` > 1, Kafka is a :class:`~oncely.devstack.cluster.KafkaCluster` of that many
    combined broker+controller nodes (replication factor ``min(3, brokers)``, default
    ``min.insync.replicas`` one less), each with a 384 MB heap; it cannot be combined with
    ``kafka_security``. ``postgres_settings`` are more PostgreSQL server settings.
    """

    def __init__(
        self,
        *,
        directory: Path | None = None,
        kafka_version: str | None = None,
        keep_data: bool = False,
        kafka_security: KafkaSecurity | None = None,
        brokers: int = 1,
        postgres_settings: Mapping[str, str] | None = None,
    ) -> None:
        if brokers < 1:
            raise DevstackError(f"brokers must be at least 1, not {brokers}")
        if brokers > 1 and kafka_security is not None:
            raise DevstackError("kafka_security is only available with one broker")
        self.directory = directory or Path(tempfile.mkdtemp(prefix="oncely-devstack-"))
        self.kafka_version = kafka_version or os.environ.get(
            "ONCELY_DEVSTACK_KAFKA_VERSION", DEFAULT_KAFKA_VERSION
        )
        self.keep_data = keep_data
        self.kafka_security = kafka_security
        self.brokers = brokers
        self.postgres_settings = dict(postgres_settings or {})
        self._kafka: KafkaNode | None = None
        self._cluster: KafkaCluster | None = None
        self._postgres: PostgresNode | None = None
        self.info: StackInfo | None = None

    def start(self) -> StackInfo:
        """Start PostgreSQL, then Kafka; on any failure stop what started and re-raise."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._postgres = PostgresNode(
                data_dir=self.directory / "postgres", settings=self.postgres_settings
            )
            self._postgres.start()
            if self.brokers > 1:
                self._cluster = KafkaCluster(
                    data_dir=self.directory / "kafka",
                    size=self.brokers,
                    version=self.kafka_version,
                )
                self._cluster.start()
                self._kafka = self._cluster.node(1)
                nodes = [self._cluster.node(i) for i in self._cluster.node_ids]
                bootstrap = self._cluster.bootstrap_servers
            else:
                self._kafka = KafkaNode(
                    data_dir=self.directory / "kafka",
                    version=self.kafka_version,
                    security=self.kafka_security,
                )
                self._kafka.start()
                nodes, bootstrap = [self._kafka], self._kafka.bootstrap_servers
        except BaseException:
            self.stop()
            raise
        assert self._kafka.pid is not None
        assert self._postgres.pid is not None
        self.info = StackInfo(
            kafka_bootstrap=bootstrap,
            kafka_version=self._kafka.logged_version() or f"{self.kafka_version} (not yet logged)",
            database_url=self._postgres.url,
            postgres_version=self._postgres.server_version(),
            supervisor_pid=os.getpid(),
            kafka_pid=self._kafka.pid,
            postgres_pid=self._postgres.pid,
            kafka_log=str(self._kafka.log_file),
            postgres_log=str(self._postgres.log_file),
            kafka_sasl_bootstrap=self._kafka.sasl_bootstrap_servers,
            kafka_sasl_ssl_bootstrap=self._kafka.sasl_ssl_bootstrap_servers,
            kafka_nodes=tuple(
                KafkaNodeInfo(
                    node_id=node.config.node_id,
                    bootstrap=node.bootstrap_servers,
                    pid=node.pid or 0,
                    log=str(node.log_file),
                )
                for node in nodes
            ),
        )
        return self.info

    def stop(self) -> None:
        """Stop both services and, unless ``keep_data``, delete their data. Idempotent."""
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None
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
    data["kafka_nodes"] = tuple(KafkaNodeInfo(**node) for node in data.get("kafka_nodes", []))
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
