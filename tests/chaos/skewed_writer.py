"""Stage the harness's events from a process whose wall clock is off: ``python -m`` this module
with the number of seconds to write for.

The clock is moved as for a skewed relay (:mod:`tests.chaos.skewed_clock`,
``ONCELY_TEST_CLOCK_SKEW_SECONDS``), so the event ids ``stage()`` makes (UUIDv7: the writer's
clock) are off by the skew while their rows' ``created_at`` (the database's clock) is not: a
row's partition is the one of its writer's clock. It stages as
:meth:`tests.chaos.harness.Pipeline.write_until` does (batches of 13 events in business
transactions, one rolled back in each, a quarter second apart), on keys of its own
(``skew-``), on the pipeline's database and app (``ONCELY_DATABASE_URL``,
``ONCELY_TEST_TOPIC_PREFIX``, ``ONCELY_TEST_GROUP_PREFIX``). A batch whose staging fails is
logged (``staging failed: ...``) and the writer goes on; it ends with ``wrote N batches, F
failed`` and exits 0 (the scenario reads the log).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import time
from pathlib import Path

from tests.chaos.skewed_clock import SKEW_ENV, skew_clock

KEY_PREFIX = "skew-"
BATCH = 13


def main() -> None:
    seconds = float(sys.argv[1])
    skew = float(os.environ[SKEW_ENV])
    import psycopg  # noqa: F401  (its C types keep the stdlib's classes, as in skewed_clock)

    skew_clock(skew)
    print(
        f"clock skewed by {skew:+.0f} s: datetime.now() = {_dt.datetime.now().isoformat()}",
        file=sys.stderr,
        flush=True,
    )

    import sqlalchemy as sa

    from tests.apps.ledger import build
    from tests.chaos.harness import Pipeline

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    url = os.environ["ONCELY_DATABASE_URL"]
    app = build(
        os.environ["ONCELY_TEST_TOPIC_PREFIX"],
        group_prefix=os.environ["ONCELY_TEST_GROUP_PREFIX"],
        ways=True,
    )
    engine = sa.create_engine(url, pool_size=2)
    writer = Pipeline(engine, url, os.environ["ONCELY_KAFKA_BOOTSTRAP_SERVERS"], app, Path())
    deadline = time.monotonic() + seconds
    batches = failed = 0
    while time.monotonic() < deadline:
        try:
            writer.write(BATCH, keys=20, rollback_every=BATCH, seed=batches, key_prefix=KEY_PREFIX)
        except Exception as exc:  # counted and logged: the scenario fails on it
            failed += 1
            cause = getattr(exc, "orig", None) or exc
            print(f"staging failed: {type(cause).__name__}: {cause}", file=sys.stderr, flush=True)
        batches += 1
        time.sleep(0.25)
    engine.dispose()
    print(f"wrote {batches} batches, {failed} failed", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
