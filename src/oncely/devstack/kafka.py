"""A real Apache Kafka broker for development and tests: resolved from Maven Central, KRaft mode.

The broker runs as ``java -cp <libs>/* kafka.Kafka`` in combined broker+controller mode on
127.0.0.1. Its classpath is resolved once per version with Maven (:mod:`oncely.devstack.jvm`)
into a cache folder; a resolution is only reused when it completed (a marker file), so an
interrupted download is redone rather than half-used.
"""

from __future__ import annotations

import base64
import re
import shutil
import signal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from oncely.devstack._process import ServerProcess, free_ports, run_tool
from oncely.devstack.jvm import (
    cache_root,
    check_java,
    copy_dependencies,
    jvm_command,
    resolve_once,
)
from oncely.errors import DevstackError

DEFAULT_KAFKA_VERSION = "4.4.0"


def resolve_kafka_libs(
    version: str = DEFAULT_KAFKA_VERSION, *, cache_dir: Path | None = None
) -> Path:
    """Return a folder holding the broker's runtime jars, resolving them with Maven if needed.

    Raises :class:`~oncely.errors.ToolMissingError` when Maven is missing and
    :class:`DevstackError` when the resolution fails (the message carries Maven's own output).
    """
    home = (cache_dir or cache_root()) / f"kafka-{version}"
    libs = home / "libs"
    marker = home / ".resolved"

    def resolve() -> None:
        staging = copy_dependencies(
            home,
            "kafka-pom.xml",
            {"kafka.version": version},
            wanted=f"kafka_2.13-{version}.jar",
            resolves=f"the Kafka broker (org.apache.kafka:kafka_2.13:{version})",
        )
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
        marker.write_text(version + "\n")

    resolve_once(home, lambda: marker.exists() and libs.is_dir(), resolve)
    return libs


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as Kafka's Uuid)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


#: The SASL mechanism of the devstack's authenticated listeners.
SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, kw_only=True)
class KafkaTls:
    """The broker's TLS identity: a PKCS12 keystore holding its key and certificate chain.

    Clients trust it through the CA that signed the certificate (librdkafka
    ``ssl.ca.location``; oncely's ``ONCELY_KAFKA_SSL_CA_LOCATION``).
    """

    keystore: Path
    keystore_password: str = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class KafkaSecurity:
    """Authenticated listeners of a devstack broker, next to its PLAINTEXT one.

    ``scram_users`` (name -> password) are SCRAM-SHA-512 credentials written into the storage
    at format time (``StorageTool format --add-scram``), so they exist before the broker first
    starts. The broker gets a ``SASL_PLAINTEXT`` listener and, with ``tls``, a ``SASL_SSL``
    listener; the PLAINTEXT listener (``bootstrap_servers``) stays for inter-broker traffic
    and tooling. Without ``authorizer`` any authenticated user may do anything; with it the
    broker runs KRaft's ``StandardAuthorizer``: the PLAINTEXT and controller principal
    (``User:ANONYMOUS``) is a super user, and everyone may do what no ACL denies, so a test
    denies one user one topic with a single ACL.
    """

    scram_users: Mapping[str, str] = field(repr=False)
    tls: KafkaTls | None = None
    authorizer: bool = False

    def __post_init__(self) -> None:
        if not self.scram_users:
            raise DevstackError("KafkaSecurity needs at least one SCRAM user")
        for name, password in self.scram_users.items():
            # The credentials go into a "[name=...,password=...]" argument: keep it parseable.
            if not _SCRAM_NAME.fullmatch(name) or not password or set(password) & set(",[]="):
                raise DevstackError(
                    f"SCRAM user {name!r}: use 1-64 characters of [A-Za-z0-9_.-] for the name "
                    "and a non-empty password without ',', '[', ']' or '='"
                )

    def format_arguments(self) -> list[str]:
        """``StorageTool format`` arguments that create the SCRAM credentials."""
        arguments = []
        for name, password in self.scram_users.items():
            arguments += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
        return arguments


@dataclass(frozen=True, kw_only=True)
class KafkaQuorum:
    """One node's place in a multi-node KRaft cluster (see :mod:`oncely.devstack.cluster`).

    Every node is formatted with the same ``cluster_id`` and ``initial_controllers``
    (``id@host:port:directory-id,...``, ``StorageTool format --initial-controllers``: a dynamic
    quorum, so ``controller.quorum.voters`` stays unset) and finds the quorum through
    ``bootstrap_servers`` (``controller.quorum.bootstrap.servers``). The internal topics get
    ``replication_factor`` replicas; ``min_insync_replicas`` is the brokers' default.
    """

    cluster_id: str
    bootstrap_servers: str
    initial_controllers: str
    replication_factor: int
    min_insync_replicas: int


@dataclass(frozen=True, kw_only=True)
class KafkaNodeConfig:
    """Ports and folders of one combined broker+controller node.

    Without ``security`` the node has one PLAINTEXT listener on ``port``. With it, a
    ``SASL_PLAINTEXT`` listener on ``sasl_port`` and, when ``security.tls`` is set, a
    ``SASL_SSL`` listener on ``sasl_ssl_port`` are added (both ports are then required).
    Without ``quorum`` the node is a single-node cluster (``--standalone``, replication 1).
    With ``proxied_by`` (``host:port`` of a TCP proxy in front of the node), one more PLAINTEXT
    listener, ``PROXIED``, is bound on ``proxied_port`` and advertised as ``proxied_by``.
    """

    data_dir: Path
    port: int
    controller_port: int
    node_id: int = 1
    heap: str = "512m"
    security: KafkaSecurity | None = None
    sasl_port: int | None = None
    sasl_ssl_port: int | None = None
    quorum: KafkaQuorum | None = None
    proxied_by: str | None = None
    proxied_port: int | None = None

    def _listeners(self) -> list[tuple[str, str, int]]:
        """(listener name, security protocol, port) of every client-facing listener."""
        listeners = [("PLAINTEXT", "PLAINTEXT", self.port)]
        if self.security is not None:
            if self.sasl_port is None:
                raise DevstackError("a KafkaNodeConfig with security needs sasl_port")
            listeners.append(("SASL_PLAINTEXT", "SASL_PLAINTEXT", self.sasl_port))
            if self.security.tls is not None:
                if self.sasl_ssl_port is None:
                    raise DevstackError("a KafkaNodeConfig with TLS needs sasl_ssl_port")
                listeners.append(("SASL_SSL", "SASL_SSL", self.sasl_ssl_port))
        return listeners

    def server_properties(self) -> str:
        listeners = self._listeners()
        bound = ",".join(f"{name}://127.0.0.1:{port}" for name, _, port in listeners)
        protocols = ",".join(f"{name}:{protocol}" for name, protocol, _ in listeners)
        advertised = bound
        if self.proxied_by is not None:
            if self.proxied_port is None or not re.fullmatch(r"[^\s:,]+:\d+", self.proxied_by):
                raise DevstackError(
                    f"proxied_by={self.proxied_by!r}: use host:port, and set proxied_port"
                )
            bound += f",PROXIED://127.0.0.1:{self.proxied_port}"
            advertised += f",PROXIED://{self.proxied_by}"
            protocols += ",PROXIED:PLAINTEXT"
        quorum = self.quorum
        voters = quorum.bootstrap_servers if quorum else f"127.0.0.1:{self.controller_port}"
        replicas, min_isr = (
            (quorum.replication_factor, quorum.min_insync_replicas) if quorum else (1, 1)
        )
        lines = [
            "process.roles=broker,controller",
            f"node.id={self.node_id}",
            f"controller.quorum.bootstrap.servers={voters}",
            f"listeners={bound},CONTROLLER://127.0.0.1:{self.controller_port}",
            f"advertised.listeners={advertised}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{protocols}",
            f"log.dirs={self.data_dir / 'kraft-logs'}",
            "num.partitions=1",
            "auto.create.topics.enable=false",
            f"default.replication.factor={replicas}",
            f"min.insync.replicas={min_isr}",
            f"offsets.topic.replication.factor={replicas}",
            "offsets.topic.num.partitions=10",
            f"transaction.state.log.replication.factor={replicas}",
            f"transaction.state.log.min.isr={min_isr}",
            "transaction.state.log.num.partitions=4",
            f"share.coordinator.state.topic.replication.factor={replicas}",
            f"share.coordinator.state.topic.min.isr={min_isr}",
            "group.initial.rebalance.delay.ms=0",
        ]
        if self.security is not None:
            lines.append(f"sasl.enabled.mechanisms={SCRAM_MECHANISM}")
            login = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            for name, protocol, _ in listeners:
                if protocol.startswith("SASL_"):
                    prefix = f"listener.name.{name.lower()}.{SCRAM_MECHANISM.lower()}"
                    lines.append(f"{prefix}.sasl.jaas.config={login}")
            if self.security.tls is not None:
                tls = self.security.tls
                lines += [
                    "ssl.keystore.type=PKCS12",
                    f"ssl.keystore.location={tls.keystore}",
                    f"ssl.keystore.password={tls.keystore_password}",
                    "ssl.client.auth=none",
                ]
            if self.security.authorizer:
                lines += [
                    "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                    "super.users=User:ANONYMOUS",
                    "allow.everyone.if.no.acl.found=true",
                ]
        return "\n".join([*lines, ""])


class KafkaNode(ServerProcess):
    """One Kafka broker process (KRaft combined mode) on 127.0.0.1.

    ``start()`` returns once an AdminClient sees the broker; ``stop()`` shuts it down with SIGTERM
    (SIGKILL after a bound). The process gets SIGTERM if its parent dies.

    ``proxied_by="host:port"`` puts a TCP proxy (fault injection) in the clients' path: Kafka
    answers metadata with the advertised address of the listener a request came in on, so a
    client that bootstraps through the proxy would otherwise be sent to the broker's own port.
    The node then also listens on :attr:`proxied_listener` (where the proxy forwards to) and
    advertises that listener as ``proxied_by``; :attr:`bootstrap_servers` stays direct.
    """

    title = "the Kafka broker"

    def __init__(
        self,
        *,
        data_dir: Path,
        version: str = DEFAULT_KAFKA_VERSION,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
        security: KafkaSecurity | None = None,
        node_id: int = 1,
        quorum: KafkaQuorum | None = None,
        proxied_by: str | None = None,
    ) -> None:
        super().__init__()
        self.version = version
        spare = iter(free_ports(5))
        self.config = KafkaNodeConfig(
            data_dir=data_dir,
            port=port or next(spare),
            controller_port=controller_port or next(spare),
            node_id=node_id,
            quorum=quorum,
            heap=heap,
            security=security,
            sasl_port=next(spare) if security is not None else None,
            sasl_ssl_port=next(spare) if security is not None and security.tls else None,
            proxied_by=proxied_by,
            proxied_port=next(spare) if proxied_by is not None else None,
        )

    @property
    def bootstrap_servers(self) -> str:
        """The PLAINTEXT listener (always there)."""
        return f"127.0.0.1:{self.config.port}"

    @property
    def sasl_bootstrap_servers(self) -> str | None:
        """The SASL_PLAINTEXT listener (SCRAM-SHA-512), when the node has ``security``."""
        port = self.config.sasl_port
        return f"127.0.0.1:{port}" if port is not None else None

    @property
    def sasl_ssl_bootstrap_servers(self) -> str | None:
        """The SASL_SSL listener (TLS + SCRAM-SHA-512), when ``security.tls`` is set."""
        port = self.config.sasl_ssl_port
        return f"127.0.0.1:{port}" if port is not None else None

    @property
    def proxied_listener(self) -> str | None:
        """The PROXIED listener's own address (the proxy's upstream), with ``proxied_by``."""
        port = self.config.proxied_port
        return f"127.0.0.1:{port}" if port is not None else None

    @property
    def log_file(self) -> Path:
        return self.config.data_dir / "logs" / "server.log"

    @property
    def _output_file(self) -> Path:
        return self.log_file.with_name("stdout.log")

    def start(self, *, timeout: float = 90.0, wait: bool = True) -> None:
        """Resolve, format and start the broker; raise :class:`DevstackError` if it fails.

        With ``wait=False`` it returns once the process runs: a node of a multi-node cluster
        cannot answer before a majority of the quorum runs (then call :meth:`wait_ready`).

        With ``security``, the SCRAM users are created when the storage is formatted (first
        start of a data folder); a data folder formatted without them keeps lacking them.
        """
        data = self.config.data_dir
        (data / "logs").mkdir(parents=True, exist_ok=True)
        properties = data / "server.properties"
        properties.write_text(self.config.server_properties())
        java = partial(
            jvm_command,
            check_java(),
            heap=(self.config.heap, self.config.heap),
            logs=data / "logs",
            log_config="log4j2.properties",
            libs=resolve_kafka_libs(self.version),
        )
        if not (data / "kraft-logs" / "meta.properties").exists():
            self._format(java(main_class="kafka.tools.StorageTool"), properties)
        self._launch([*java(main_class="kafka.Kafka"), str(properties)])
        if wait:
            self.wait_ready(timeout=timeout)

    def _format(self, storage_tool: list[str], properties: Path) -> None:
        """Format a new data folder: a standalone controller, or this node of the quorum."""
        quorum = self.config.quorum
        membership = (
            ["-t", quorum.cluster_id, "--initial-controllers", quorum.initial_controllers]
            if quorum
            else ["-t", new_cluster_id(), "--standalone"]
        )
        run_tool(
            [
                *storage_tool,
                "format",
                "-c",
                str(properties),
                *membership,
                *(self.config.security.format_arguments() if self.config.security else []),
            ],
            doing="formatting the Kafka storage",
        )

    def wait_ready(self, *, timeout: float = 90.0) -> None:
        """Return once an AdminClient sees the started broker; :class:`DevstackError` if not."""
        if self._proc is None:
            raise DevstackError("the Kafka broker is not started")
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})

        def answers() -> bool:
            try:
                return bool(admin.list_topics(timeout=2).brokers)
            except KafkaException:
                return False

        self._wait_until(
            answers,
            timeout=timeout,
            unready=f"the Kafka broker did not answer on {self.bootstrap_servers}",
        )

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the running broker (SIGSTOP and SIGCONT pause and resume it)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would; its data stays, :meth:`start` brings it back."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def logged_version(self) -> str | None:
        """The version the running broker logged at start-up ("Kafka version: X"), if seen."""
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return None
        match = re.search(r"Kafka version: (\S+)", text)
        return match.group(1) if match else None
