"""Wake an idle loop on a PostgreSQL notification: ``LISTEN``, with polling as the fallback.

The relay listens on ``oncely_outbox`` (staging notifies at commit while a relay is marked
asleep, so writers take no commit-time NOTIFY lock under load), the task worker on
``oncely_tasks`` (every enqueue notifies at commit). When the listening connection fails,
:meth:`Wakeup.wait` falls back to a plain timed wait and reconnects on the next call, so a lost
notification only delays work until the next poll.
"""

from __future__ import annotations

import logging
import threading

import psycopg
import sqlalchemy as sa

log = logging.getLogger(__name__)


class Wakeup:
    """Block until a notification arrives on ``channel`` or ``timeout`` passes."""

    def __init__(self, dsn: str, *, channel: str, stop: threading.Event) -> None:
        self._dsn = dsn
        self._channel = channel
        self._stop = stop
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    @classmethod
    def of(cls, engine: sa.Engine, *, channel: str, stop: threading.Event) -> Wakeup:
        """A wakeup on its own connection to ``engine``'s database."""
        dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        return cls(dsn, channel=channel, stop=stop)

    def listen(self) -> None:
        """Start listening now (else the first :meth:`wait` does): a notification sent from
        here on wakes the next wait. Raises ``psycopg.Error`` when the database fails."""
        if self._conn is None:
            self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5)
            self._conn.execute(f"LISTEN {self._channel}")

    def wait(self, timeout: float) -> None:
        """Return at the next notification, or after ``timeout`` seconds."""
        try:
            self.listen()
            assert self._conn is not None
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
