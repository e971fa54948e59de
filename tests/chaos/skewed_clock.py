"""Run oncely's command line on a host whose wall clock is off: ``python -m`` this module.

``ONCELY_TEST_CLOCK_SKEW_SECONDS`` (e.g. ``7200`` or ``-7200``) moves every wall-clock reading
made from Python in this process: ``time.time``/``time_ns``, ``clock_gettime(CLOCK_REALTIME)``,
``localtime``/``gmtime``/``ctime``/``strftime`` without an argument, ``datetime.now``/
``utcnow``/``today`` and ``date.today``. The clock is moved before oncely, SQLAlchemy or
psycopg is imported, so ``from datetime import datetime`` in any of them gets the moved class,
and log lines carry the moved time. Monotonic clocks and sleeps are left alone, as a skewed
host's are. What it does not reach is C code reading the clock itself (libpq, librdkafka):
neither computes a lease, and the claim S13 checks is that no Python reading of the host clock
reaches the database either. It is a test tool, used by S13 (``test_clock_skew.py``).

Why not libfaketime (Debian ``faketime``): with Python 3.11 it either hangs every timed wait
(``threading.Event().wait(1)`` never returns) or, with ``FAKETIME_DONT_FAKE_MONOTONIC=1``, makes
``time.sleep`` fail with ``EINVAL``; a relay under it hangs at start-up with a clock ahead.
"""

from __future__ import annotations

import datetime as _dt
import os
import runpy
import sys
import time
from typing import Any

SKEW_ENV = "ONCELY_TEST_CLOCK_SKEW_SECONDS"


def skew_clock(seconds: float) -> None:
    """Move this process's Python wall clock by ``seconds`` (not reversible)."""
    skew_ns = round(seconds * 1e9)
    shift = _dt.timedelta(seconds=seconds)
    real_time, real_time_ns = time.time, time.time_ns
    real_gettime, real_gettime_ns = time.clock_gettime, time.clock_gettime_ns
    real_localtime, real_gmtime, real_ctime = time.localtime, time.gmtime, time.ctime
    real_strftime = time.strftime

    def clock_gettime(clock: int) -> float:
        value = real_gettime(clock)
        return value + seconds if clock == time.CLOCK_REALTIME else value

    def clock_gettime_ns(clock: int) -> int:
        value = real_gettime_ns(clock)
        return value + skew_ns if clock == time.CLOCK_REALTIME else value

    def localtime(secs: float | None = None) -> time.struct_time:
        return real_localtime(time.time() if secs is None else secs)

    def gmtime(secs: float | None = None) -> time.struct_time:
        return real_gmtime(time.time() if secs is None else secs)

    def ctime(secs: float | None = None) -> str:
        return real_ctime(time.time() if secs is None else secs)

    def strftime(format: str, t: Any = None) -> str:
        return real_strftime(format, time.localtime() if t is None else t)

    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + skew_ns
    time.clock_gettime, time.clock_gettime_ns = clock_gettime, clock_gettime_ns
    time.localtime, time.gmtime, time.ctime, time.strftime = localtime, gmtime, ctime, strftime

    class datetime(_dt.datetime):  # noqa: N801 (stands in for the stdlib class)
        __slots__ = ()  # the size C extensions check when they import the class

        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> Any:
            return super().now(tz) + shift

        @classmethod
        def utcnow(cls) -> Any:
            return super().utcnow() + shift

        @classmethod
        def today(cls) -> Any:
            return cls.now()

    class date(_dt.date):  # noqa: N801
        __slots__ = ()

        @classmethod
        def today(cls) -> Any:
            return cls.fromtimestamp(time.time())

    for stand_in, name in ((datetime, "datetime"), (date, "date")):
        stand_in.__module__, stand_in.__qualname__ = "datetime", name
    _dt.datetime, _dt.date = datetime, date  # type: ignore[misc]


def main() -> None:
    seconds = float(os.environ[SKEW_ENV])
    # psycopg's C extension types its date/time arguments with the classes it imports: it must
    # keep the stdlib's (the values it gets from the server are made by the C API). It is a
    # driver: it never reads the wall clock to decide anything.
    import psycopg  # noqa: F401

    skew_clock(seconds)
    print(
        f"clock skewed by {seconds:+.0f} s: datetime.now() = {_dt.datetime.now().isoformat()}",
        file=sys.stderr,
        flush=True,
    )
    sys.argv[0] = "oncely"
    runpy.run_module("oncely", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
