"""Kafka Connect with Debezium's PostgreSQL connector from Maven Central, for dev and tests.

The worker runs as ``java -cp <libs>/* org.apache.kafka.connect.cli.ConnectStandalone
worker.properties`` on 127.0.0.1 (offsets in a local file, no internal topics). Its classpath
(``connect-runtime`` of the broker's Kafka version, with an SLF4J binding and the OpenTelemetry
SDK) and Debezium's plugin folder (the ``debezium-connector-postgres`` ``plugin`` archive:
connector, Outbox Event Router, JDBC driver) are resolved once per version pair with Maven into a
cache folder; a resolution is only reused when it completed (a marker file). Connectors are
added through the REST API.

The SDK is configured by :data:`TRACING_PROPERTIES` (W3C propagation, no exporter): the
router's tracing SMT then continues the trace staged with each row, as a Kafka Connect with an
OpenTelemetry Java agent or SDK does in production.
"""

from __future__ import annotations

import http.client
import json
import shutil
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oncely.devstack._process import ServerProcess, free_port, tail
from oncely.devstack.jvm import (
    cache_root,
    check_java,
    copy_dependencies,
    jvm_command,
    resolve_once,
)
from oncely.devstack.kafka import DEFAULT_KAFKA_VERSION
from oncely.errors import DevstackError

DEFAULT_DEBEZIUM_VERSION = "3.6.1.Final"
#: The OpenTelemetry SDK on the worker's classpath (connect-pom.xml): part of the cache's name.
OPENTELEMETRY_VERSION = "1.68.0"
#: The SDK's autoconfiguration: the global OpenTelemetry that Debezium's tracing SMT asks for
#: propagates W3C trace context and exports nothing.
TRACING_PROPERTIES = {
    "otel.java.global-autoconfigure.enabled": "true",
    "otel.service.name": "oncely-devstack-connect",
    "otel.propagators": "tracecontext,baggage",
    "otel.traces.exporter": "none",
    "otel.metrics.exporter": "none",
    "otel.logs.exporter": "none",
}
_PLUGIN_ARCHIVE = "debezium-connector-postgres-{version}-plugin.tar.gz"
_MAIN_CLASS = "org.apache.kafka.connect.cli.ConnectStandalone"


def resolve_connect(
    kafka_version: str = DEFAULT_KAFKA_VERSION,
    debezium_version: str = DEFAULT_DEBEZIUM_VERSION,
    *,
    cache_dir: Path | None = None,
) -> tuple[Path, Path]:
    """Return ``(libs, plugins)``: Connect's classpath folder and the ``plugin.path`` folder.

    Resolves them with Maven the first time (a few minutes; about 60 MB).

    Raises:
        ToolMissingError: Maven is not installed.
        DevstackError: the resolution failed (the message carries Maven's own output).
    """
    home = (cache_dir or cache_root()) / (
        f"connect-{kafka_version}-debezium-{debezium_version}-otel-{OPENTELEMETRY_VERSION}"
    )
    libs, plugins, marker = home / "libs", home / "plugins", home / ".resolved"

    def resolve() -> None:
        archive_name = _PLUGIN_ARCHIVE.format(version=debezium_version)
        staging = copy_dependencies(
            home,
            "connect-pom.xml",
            {
                "kafka.version": kafka_version,
                "debezium.version": debezium_version,
                "opentelemetry.version": OPENTELEMETRY_VERSION,
            },
            wanted=archive_name,
            resolves=f"Kafka Connect (org.apache.kafka:connect-runtime:{kafka_version}) and "
            f"Debezium (io.debezium:debezium-connector-postgres:{debezium_version}, plugin tar.gz)",
            missing_hint="Docker users can run `docker compose --profile debezium up -d connect` "
            "instead.",
        )
        archive = staging / archive_name
        plugin_staging = home / "plugins.partial"
        shutil.rmtree(plugin_staging, ignore_errors=True)
        plugin_staging.mkdir()
        with tarfile.open(archive) as tar:
            tar.extractall(plugin_staging, filter="data")
        archive.unlink()
        for final, partial in ((libs, staging), (plugins, plugin_staging)):
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
        marker.write_text(f"{kafka_version} {debezium_version}\n")

    resolve_once(home, lambda: marker.exists() and libs.is_dir() and plugins.is_dir(), resolve)
    return libs, plugins


def worker_properties(
    *, bootstrap_servers: str, plugin_path: Path, offsets_file: Path, rest_port: int
) -> str:
    """A standalone worker's properties: local offsets file, REST API on 127.0.0.1 only."""
    return "\n".join(
        [
            f"bootstrap.servers={bootstrap_servers}",
            "key.converter=org.apache.kafka.connect.storage.StringConverter",
            "value.converter=org.apache.kafka.connect.converters.ByteArrayConverter",
            f"offset.storage.file.filename={offsets_file}",
            "offset.flush.interval.ms=1000",
            f"plugin.path={plugin_path}",
            # Every plugin here ships a ServiceLoader manifest: no slow class-path scan.
            "plugin.discovery=service_load",
            f"listeners=http://127.0.0.1:{rest_port}",
            "rest.advertised.host.name=127.0.0.1",
            "",
        ]
    )


class ConnectNode(ServerProcess):
    """One Kafka Connect standalone worker with Debezium's PostgreSQL connector installed.

    ``start()`` returns once the REST API answers; :meth:`add_connector` returns once the
    connector and its task are RUNNING; ``stop()`` shuts the worker down with SIGTERM (SIGKILL
    after a bound), which stops the connectors and releases their replication slots (it does not
    drop them: see :func:`oncely.debezium.drop_slot`). The worker gets SIGTERM if its parent
    dies.
    """

    title = "Kafka Connect"

    def __init__(
        self,
        *,
        data_dir: Path,
        bootstrap_servers: str,
        kafka_version: str = DEFAULT_KAFKA_VERSION,
        debezium_version: str = DEFAULT_DEBEZIUM_VERSION,
        rest_port: int | None = None,
        heap: str = "512m",
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.bootstrap_servers = bootstrap_servers
        self.kafka_version = kafka_version
        self.debezium_version = debezium_version
        self.rest_port = rest_port or free_port()
        self.heap = heap

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "logs" / "connect.log"

    @property
    def _output_file(self) -> Path:
        return self.log_file.with_name("stdout.log")

    def _answers(self) -> bool:
        try:
            # The REST server answers 404 until its resources are initialised.
            return self._request("GET", "/")[0] == http.client.OK
        except (OSError, http.client.HTTPException):
            return False

    def start(self, *, timeout: float = 120.0) -> None:
        """Resolve (the first time) and start the worker; return once its REST API answers.

        Raises:
            ToolMissingError: Java 17+ or Maven is missing (names what to install).
            DevstackError: the resolution failed, or the worker exited or did not answer
                within ``timeout`` seconds (with the last lines of its log).
        """
        java = check_java()
        libs, plugins = resolve_connect(self.kafka_version, self.debezium_version)
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        properties = self.data_dir / "worker.properties"
        properties.write_text(
            worker_properties(
                bootstrap_servers=self.bootstrap_servers,
                plugin_path=plugins,
                offsets_file=self.data_dir / "connect.offsets",
                rest_port=self.rest_port,
            )
        )
        command = jvm_command(
            java,
            heap=("128m", self.heap),
            logs=logs,
            log_config="connect-log4j2.properties",
            libs=libs,
            main_class=_MAIN_CLASS,
            properties=TRACING_PROPERTIES,
        )
        self._launch([*command, str(properties)])
        self._wait_until(
            self._answers,
            timeout=timeout,
            unready=f"Kafka Connect's REST API did not answer on {self.rest_url}",
        )

    def add_connector(self, name: str, config: Mapping[str, str], *, timeout: float = 60.0) -> None:
        """Create (or reconfigure) connector ``name`` and wait until it and its task run.

        Raises:
            DevstackError: Connect rejected the configuration, the connector or its task
                failed (with Connect's trace), or it did not run within ``timeout`` seconds.
        """
        status, body = self._request("PUT", f"/connectors/{name}/config", dict(config))
        if status >= http.client.BAD_REQUEST:
            raise DevstackError(f"Kafka Connect rejected connector {name!r} ({status}): {body}")
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive(f"while starting connector {name!r}")
            state = self.connector_status(name)
            states = [state.get("connector", {}), *state.get("tasks", [])]
            failed = [s for s in states if s.get("state") == "FAILED"]
            if failed:
                raise DevstackError(
                    f"connector {name!r} failed: {failed[0].get('trace', '(no trace)')[:4000]}"
                )
            if len(states) > 1 and all(s.get("state") == "RUNNING" for s in states):
                return
            if time.monotonic() > deadline:
                raise DevstackError(
                    f"connector {name!r} was not RUNNING within {timeout:.0f} s ({state}); last "
                    f"lines of {self.log_file}:\n{tail(self.log_file)}"
                )
            time.sleep(0.3)

    def remove_connector(self, name: str, *, timeout: float = 30.0) -> None:
        """Delete connector ``name`` and wait until Connect no longer knows it (idempotent).

        Its task stops and closes its replication connection; the slot stays (see
        :func:`oncely.debezium.drop_slot`). Raises :class:`DevstackError` on a timeout.
        """
        self._request("DELETE", f"/connectors/{name}")
        deadline = time.monotonic() + timeout
        while self._request("GET", f"/connectors/{name}")[0] != http.client.NOT_FOUND:
            if time.monotonic() > deadline:
                raise DevstackError(f"connector {name!r} was not deleted within {timeout:.0f} s")
            time.sleep(0.2)

    def connector_status(self, name: str) -> dict[str, Any]:
        """``GET /connectors/<name>/status`` (empty when Connect does not know it yet)."""
        status, body = self._request("GET", f"/connectors/{name}/status")
        return body if status == http.client.OK and isinstance(body, dict) else {}

    def _request(self, method: str, path: str, payload: object = None) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.rest_port, timeout=10)
        try:
            body = None if payload is None else json.dumps(payload)
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return response.status, raw.decode(errors="replace")
