"""Wake the relay when rows are staged: ``LISTEN oncely_outbox``, with polling as the fallback.

While a relay is marked asleep (``oncely_relay_members.asleep``), staging fires
``NOTIFY oncely_outbox`` at commit (a statement-level insert trigger); while every relay is
awake it sends none, so writers take no commit-time NOTIFY lock under load. When the listening
connection fails, :meth:`Wakeup.wait` falls back to a plain timed wait and reconnects on the
next call, so a lost notification only delays a row until the next poll.
"""

from __future__ import annotations

import logging
import threading

import psycopg

from oncely.storage.tables import NOTIFY_CHANNEL

log = logging.getLogger(__name__)


class Wakeup:
    """Block until a notification arrives on ``oncely_outbox`` or ``timeout`` passes."""

    def __init__(self, dsn: str, *, stop: threading.Event) -> None:
        self._dsn = dsn
        self._stop = stop
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def wait(self, timeout: float) -> None:
        try:
            if self._conn is None:
                self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
                self._conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            for _ in self._conn.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.Error as exc:
            log.warning("LISTEN connection failed, polling instead: %s", exc)
            self.close()
            self._stop.wait(timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
