"""Wake an idle loop on a PostgreSQL notification: ``LISTEN``, with polling as the fallback.

The relay listens on ``oncely_outbox`` (staging notifies at commit while a relay is marked
asleep, so writers take no commit-time NOTIFY lock under load; see :mod:`oncely.relay.pace`),
the task worker on
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
        self._listening = False

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
            self._listening = False
        if not self._listening:
            self._conn.execute(f"LISTEN {self._channel}")
            self._listening = True

    def unlisten(self) -> None:
        """Stop listening (a notification sent from here on is not delivered); pending ones
        are dropped. Raises ``psycopg.Error`` when the database fails."""
        if self._conn is not None and self._listening:
            self._conn.execute(f"UNLISTEN {self._channel}")
            self._listening = False
            self._take()

    def wait(self, timeout: float) -> bool:
        """Return at the next notification (``True``, with every other one pending taken too),
        or after ``timeout`` seconds (``False``). When the connection fails the wait is a plain
        timed one and returns ``True``: something may have been missed."""
        try:
            self.listen()
            assert self._conn is not None
            notified = bool(list(self._conn.notifies(timeout=timeout, stop_after=1)))
            return self._take() or notified
        except psycopg.Error as exc:
            self._failed(exc)
            self._stop.wait(timeout)
            return True

    def pending(self) -> bool:
        """Whether a notification arrived since the last call (taking them all), without
        waiting; ``True`` when the connection failed (something may have been missed)."""
        if self._conn is None:
            return False
        try:
            return self._take()
        except psycopg.Error as exc:
            self._failed(exc)
            return True

    def _take(self) -> bool:
        assert self._conn is not None
        return bool(list(self._conn.notifies(timeout=0)))

    def _failed(self, exc: psycopg.Error) -> None:
        log.warning("LISTEN connection failed, polling instead: %s", exc)
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
