"""A real Apache Kafka broker for development and tests: resolved from Maven Central, KRaft mode.

The broker runs as ``java -cp <libs>/* kafka.Kafka`` in combined broker+controller mode on
127.0.0.1. Its classpath is resolved once per version with Maven into a cache folder; a
resolution is only reused when it completed (a marker file), so an interrupted download is
redone rather than half-used.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from oncely.devstack._process import die_with_parent, free_port, stop_process, tail
from oncely.errors import DevstackError, ToolMissingError

DEFAULT_KAFKA_VERSION = "4.4.0"
_MIN_JAVA = 17
_DOCKER_HINT = "Docker users can run `docker compose up -d postgres kafka` instead."


def cache_root() -> Path:
    """Where resolved classpaths live: ``$ONCELY_CACHE_DIR`` or ``~/.cache/oncely``."""
    configured = os.environ.get("ONCELY_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "oncely"


def check_java() -> str:
    """Return the path of a Java 17+ ``java``; raise :class:`ToolMissingError` otherwise."""
    java = shutil.which("java")
    if java is None:
        raise ToolMissingError(
            f"`java` was not found on PATH: install a Java {_MIN_JAVA}+ runtime "
            f"(Debian: apt-get install openjdk-17-jre-headless). {_DOCKER_HINT}"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    major = int(match.group(1)) if match else 0
    if major == 1 and match and match.group(2):
        major = int(match.group(2))
    if major < _MIN_JAVA:
        raise ToolMissingError(
            f"Kafka 4 needs Java {_MIN_JAVA}+, but {java} reports "
            f"{(out.stderr or out.stdout).strip().splitlines()[:1]}: install openjdk-17 or newer. "
            f"{_DOCKER_HINT}"
        )
    return java


def resolve_kafka_libs(
    version: str = DEFAULT_KAFKA_VERSION, *, cache_dir: Path | None = None
) -> Path:
    """Return a folder holding the broker's runtime jars, resolving them with Maven if needed.

    Raises :class:`ToolMissingError` when Maven is missing and :class:`DevstackError` when the
    resolution fails (the message carries Maven's own output).
    """
    home = (cache_dir or cache_root()) / f"kafka-{version}"
    libs = home / "libs"
    marker = home / ".resolved"
    if marker.exists() and libs.is_dir():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ToolMissingError(
            "`mvn` (Apache Maven) was not found on PATH: it resolves the Kafka broker from Maven "
            f"Central (Debian: apt-get install maven). {_DOCKER_HINT}"
        )
    home.mkdir(parents=True, exist_ok=True)
    pom = home / "pom.xml"
    pom.write_bytes(resources.files(__package__).joinpath("kafka-pom.xml").read_bytes())
    staging = home / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    result = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            f"-Dkafka.version={version}",
            f"-DoutputDirectory={staging}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0 or not any(staging.glob(f"kafka_2.13-{version}.jar")):
        raise DevstackError(
            f"Maven could not resolve org.apache.kafka:kafka_2.13:{version} "
            f"(exit {result.returncode}). Check the version and that Maven Central is reachable.\n"
            + (result.stdout + result.stderr)[-4000:]
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    marker.write_text(version + "\n")
    return libs


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as Kafka's Uuid)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


@dataclass(frozen=True, kw_only=True)
class KafkaNodeConfig:
    """Ports and folders of one combined broker+controller node."""

    data_dir: Path
    port: int
    controller_port: int
    node_id: int = 1
    heap: str = "512m"

    def server_properties(self) -> str:
        return "\n".join(
            [
                "process.roles=broker,controller",
                f"node.id={self.node_id}",
                f"controller.quorum.bootstrap.servers=127.0.0.1:{self.controller_port}",
                f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                f"CONTROLLER://127.0.0.1:{self.controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                f"log.dirs={self.data_dir / 'kraft-logs'}",
                "num.partitions=1",
                "auto.create.topics.enable=false",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=10",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=4",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                "",
            ]
        )


class KafkaNode:
    """One Kafka broker process (KRaft combined mode) on 127.0.0.1.

    ``start()`` returns once an AdminClient sees the broker; ``stop()`` shuts it down with SIGTERM
    (SIGKILL after a bound). The process gets SIGTERM if its parent dies.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        version: str = DEFAULT_KAFKA_VERSION,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
    ) -> None:
        self.version = version
        self.config = KafkaNodeConfig(
            data_dir=data_dir,
            port=port or free_port(),
            controller_port=controller_port or free_port(),
            heap=heap,
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.config.port}"

    @property
    def log_file(self) -> Path:
        return self.config.data_dir / "logs" / "server.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, *, timeout: float = 90.0) -> None:
        """Resolve, format and start the broker; raise :class:`DevstackError` if it fails."""
        java = check_java()
        libs = resolve_kafka_libs(self.version)
        data = self.config.data_dir
        (data / "logs").mkdir(parents=True, exist_ok=True)
        properties = data / "server.properties"
        properties.write_text(self.config.server_properties())
        log_config = data / "log4j2.properties"
        log_config.write_bytes(
            resources.files(__package__).joinpath("log4j2.properties").read_bytes()
        )
        classpath = f"{libs}/*"
        jvm = [
            java,
            f"-Xms{self.config.heap}",
            f"-Xmx{self.config.heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={data / 'logs'}",
            f"-Dlog4j2.configurationFile={log_config}",
            "-cp",
            classpath,
        ]
        if not (data / "kraft-logs" / "meta.properties").exists():
            fmt = subprocess.run(
                [
                    *jvm,
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    new_cluster_id(),
                    "-c",
                    str(properties),
                    "--standalone",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if fmt.returncode != 0:
                raise DevstackError(
                    f"formatting the Kafka storage failed (exit {fmt.returncode}):\n"
                    + (fmt.stdout + fmt.stderr)[-4000:]
                )
        stdout = (data / "logs" / "stdout.log").open("ab")
        self._proc = subprocess.Popen(
            [*jvm, "kafka.Kafka", str(properties)],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        stdout.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        assert self._proc is not None
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise DevstackError(
                    f"the Kafka broker exited with code {self._proc.returncode} during start-up; "
                    f"last lines of {self.log_file}:\n{tail(self.log_file)}"
                    f"{tail(self.log_file.with_name('stdout.log'), 15)}"
                )
            try:
                metadata = admin.list_topics(timeout=2)
                if metadata.brokers:
                    return
            except KafkaException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise DevstackError(
                    f"the Kafka broker did not answer on {self.bootstrap_servers} within "
                    f"{timeout:.0f} s; last lines of {self.log_file}:\n{tail(self.log_file)}"
                )
            time.sleep(0.3)

    def logged_version(self) -> str | None:
        """The version the running broker logged at start-up ("Kafka version: X"), if seen."""
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return None
        match = re.search(r"Kafka version: (\S+)", text)
        return match.group(1) if match else None

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout`` seconds). Idempotent."""
        if self._proc is not None:
            stop_process(self._proc, signal.SIGTERM, timeout)
            self._proc = None
