"""A Confluent-compatible schema registry for dev and tests: Apicurio Registry from Maven Central.

Apicurio publishes its built server, a Quarkus application, beside its jar as
``io.apicurio:apicurio-registry-app:<version>:tar.gz:all``; it is resolved once per version with
Maven into a cache folder and unpacked there (about 160 MB; a resolution is only reused when it
completed: a marker file). The server runs as ``java -jar quarkus-run.jar`` on 127.0.0.1 with
in-memory storage, so every start is an empty registry. Its Confluent-compatible API is at
``/apis/ccompat/v7``: :attr:`SchemaRegistryNode.url` is what confluent-kafka's
``SchemaRegistryClient`` (and ``ONCELY_SCHEMA_REGISTRY_URL``) takes. Apicurio 3 needs Java 21+,
found through ``JAVA_HOME``, ``java`` on PATH or the JDKs in ``/usr/lib/jvm``.
"""

from __future__ import annotations

import http.client
import os
import shutil
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from oncely.devstack._process import ServerProcess, free_ports
from oncely.devstack.jvm import cache_root, copy_dependencies, java_version, resolve_once
from oncely.errors import ToolMissingError

DEFAULT_APICURIO_VERSION = "3.3.3"
#: The path of Apicurio's Confluent-compatible API (Confluent Schema Registry's v7 REST API).
CCOMPAT_PATH = "/apis/ccompat/v7"
_ARCHIVE = "apicurio-registry-app-{version}-all.tar.gz"
_MIN_JAVA = 21
_JVM_DIRS = Path("/usr/lib/jvm")


def resolve_registry(
    version: str = DEFAULT_APICURIO_VERSION, *, cache_dir: Path | None = None
) -> Path:
    """Return the folder holding Apicurio Registry's ``quarkus-run.jar``, resolving it with
    Maven the first time (about 160 MB: seconds to a minute, depending on the network).

    Raises:
        ToolMissingError: Maven is not installed.
        DevstackError: the resolution failed (the message carries Maven's own output).
    """
    home = (cache_dir or cache_root()) / f"apicurio-registry-{version}"
    app, marker = home / "app", home / ".resolved"

    def resolve() -> None:
        archive_name = _ARCHIVE.format(version=version)
        staging = copy_dependencies(
            home,
            "registry-pom.xml",
            {"apicurio.version": version},
            wanted=archive_name,
            resolves=f"Apicurio Registry (io.apicurio:apicurio-registry-app:{version}, all tar.gz)",
            missing_hint="Or run a Confluent-compatible schema registry yourself and set "
            "ONCELY_TEST_SCHEMA_REGISTRY_URL.",
        )
        unpacked = home / "app.partial"
        shutil.rmtree(unpacked, ignore_errors=True)
        unpacked.mkdir()
        with tarfile.open(staging / archive_name) as tar:
            tar.extractall(unpacked, filter="data")
        shutil.rmtree(staging)
        shutil.rmtree(app, ignore_errors=True)
        unpacked.rename(app)
        marker.write_text(version + "\n")

    resolve_once(home, lambda: marker.exists() and (app / "quarkus-run.jar").is_file(), resolve)
    return app


def find_java(minimum: int = _MIN_JAVA) -> str:
    """Return a ``java`` of version ``minimum`` or later: ``$JAVA_HOME/bin/java``, else ``java``
    on PATH, else the newest JDK in ``/usr/lib/jvm``.

    Raises :class:`ToolMissingError` naming what was found and what to install.
    """
    home = os.environ.get("JAVA_HOME")
    candidates = [str(Path(home) / "bin" / "java")] if home else []
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    candidates += [str(path) for path in sorted(_JVM_DIRS.glob("*/bin/java"))]
    found = []
    for java in dict.fromkeys(candidates):
        if not os.access(java, os.X_OK):
            continue
        major, _ = java_version(java)
        if major >= minimum:
            return java
        found.append(f"{java} ({major or 'unknown version'})")
    raise ToolMissingError(
        f"Apicurio Registry needs Java {minimum}+; found {', '.join(found) or 'no java'}: "
        f"install a JDK {minimum} or newer (e.g. Temurin) and set JAVA_HOME to it, or run a "
        "Confluent-compatible schema registry yourself and set ONCELY_TEST_SCHEMA_REGISTRY_URL"
    )


@dataclass(frozen=True, kw_only=True)
class RegistryTls:
    """HTTPS for a registry: its certificate and key (PEM files, the certificate valid for
    127.0.0.1). Client certificates cannot be required: the published server fixes
    ``quarkus.http.ssl.client-auth`` when it is built."""

    certificate: Path
    key: Path


class SchemaRegistryNode(ServerProcess):
    """One Apicurio Registry server with in-memory storage, on free ports of 127.0.0.1.

    ``start()`` returns once its health check answers; ``stop()`` stops it with SIGTERM (SIGKILL
    after a bound); it gets SIGTERM if its parent dies. ``tls`` serves the API over HTTPS only,
    ``users`` (name -> password) requires HTTP basic authentication. ``properties`` are further
    Quarkus or Apicurio settings (``-D`` system properties).
    """

    title = "Apicurio Registry"
    poll_interval = 0.2

    def __init__(
        self,
        *,
        data_dir: Path,
        version: str = DEFAULT_APICURIO_VERSION,
        heap: str = "256m",
        tls: RegistryTls | None = None,
        users: Mapping[str, str] | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.version = version
        self.heap = heap
        self.tls = tls
        self.users = dict(users or {})
        self.properties = dict(properties or {})
        self.port, self.management_port = free_ports(2)

    @property
    def url(self) -> str:
        """The Confluent-compatible API's base URL (``http(s)://127.0.0.1:<port>/apis/ccompat/v7``)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "registry.log"

    def system_properties(self) -> dict[str, str]:
        """The server's settings: ports on 127.0.0.1, no access log, then TLS, users, extras."""
        settings = {
            "quarkus.http.host": "127.0.0.1",
            "quarkus.http.port": str(self.port),
            "quarkus.management.host": "127.0.0.1",
            "quarkus.management.port": str(self.management_port),
            "quarkus.http.access-log.enabled": "false",
            "apicurio.storage.snapshot.location": str(self.data_dir),
            "apicurio.import.work-dir": str(self.data_dir),
        }
        if self.tls is not None:
            settings |= {
                "quarkus.http.ssl-port": str(self.port),
                "quarkus.http.port": "0",
                "quarkus.http.insecure-requests": "disabled",
                "quarkus.http.ssl.certificate.files": str(self.tls.certificate),
                "quarkus.http.ssl.certificate.key-files": str(self.tls.key),
            }
        if self.users:
            settings |= {
                "quarkus.http.auth.basic": "true",
                "apicurio.authn.mechanism.priority": "basic",
                "quarkus.security.users.embedded.enabled": "true",
                "quarkus.security.users.embedded.plain-text": "true",
            }
            for name, password in self.users.items():
                settings[f"quarkus.security.users.embedded.users.{name}"] = password
                settings[f"quarkus.security.users.embedded.roles.{name}"] = "sr-admin"
        return settings | self.properties

    def start(self, *, timeout: float = 120.0) -> None:
        """Resolve (the first time) and start the server; return once it is ready.

        Raises:
            ToolMissingError: Java 21+ or Maven is missing (names what to install).
            DevstackError: the resolution failed, or the server exited or was not ready within
                ``timeout`` seconds (with the last lines of its log).
        """
        java = find_java()
        app = resolve_registry(self.version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            java,
            "-Xms64m",
            f"-Xmx{self.heap}",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true",
            *(f"-D{name}={value}" for name, value in self.system_properties().items()),
            "-jar",
            str(app / "quarkus-run.jar"),
        ]
        self._launch(command, cwd=self.data_dir)
        self._wait_until(
            self._ready,
            timeout=timeout,
            unready=f"Apicurio Registry was not ready on 127.0.0.1:{self.management_port}",
        )

    def _ready(self) -> bool:
        """Whether the management interface's readiness check answers 200 (plain HTTP)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.management_port, timeout=5)
        try:
            connection.request("GET", "/health/ready")
            return connection.getresponse().status == http.client.OK
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()
