"""The cost of one completeness check on a large outbox: ``python -m bench.completeness``.

Starts an embedded PostgreSQL under ``.oncely/bench-completeness/`` (or uses ``--database-url``,
whose database it fills: give it an empty one), creates oncely's tables, and fills them with
SQL ``generate_series`` (fast): ``--rows`` outbox rows (default 10,000,000) staged evenly over
the last ``--hours`` (default 24: every row is in the default 24-hour window, past the grace
period), of ``--types`` event types (the effect consumes one of them), all published as far
as the relay's progress says; the effect's receipts for all but ``--missing`` of its events.
Then it vacuums and analyses the tables (as autovacuum would, so that index-only scans skip
the heap), runs the check (:func:`oncely.consumers.completeness.check_effect`) ``--repeat``
times, and prints its wall time and ``EXPLAIN (ANALYZE, BUFFERS)`` of its two statements.

The check's cost grows with the rows in the window (the outbox rows are read for their type),
not with the table: a table holding a week with a 24-hour window costs about a seventh.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from oncely.consumers.completeness import (
    bucket_edges,
    check_effect,
    disagreeing,
    window,
)
from oncely.devstack.postgres import PostgresNode
from oncely.ids import lowest_of_millis
from oncely.settings import CompletenessSettings
from oncely.storage import upgrade
from oncely.storage.queries import query
from oncely.storage.stores.receipts import bucket_counts, completeness_bounds

EFFECT = "bench-effect"
ROOT = Path(__file__).resolve().parents[1]

_FILL = """
INSERT INTO oncely_outbox (id, aggregatetype, aggregateid, type, topic, payload, event_key)
SELECT CAST(lpad(to_hex(t.ms), 12, '0') || '7' || substr(md5(n::text), 1, 3) || '8'
            || substr(md5(n::text), 4, 15) AS uuid),
       'account', 'acc-' || (n % 10000), 'bench.type-' || (n % :types), 'bench',
       '\\x00'::bytea, 'bench-' || n
FROM generate_series(1, :rows) AS n,
     LATERAL (SELECT CAST(:start_ms + (n - 1) * :step_ms AS bigint) AS ms) AS t
"""
_RECEIPTS = """
INSERT INTO oncely_receipts (event_id, effect)
SELECT id, :effect FROM oncely_outbox
WHERE type = 'bench.type-0'
ORDER BY id
OFFSET :missing
"""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.completeness", description=__doc__)
    parser.add_argument("--database-url", help="an empty database (default: a local server)")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--types", type=int, default=4)
    parser.add_argument("--missing", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    node = None
    url = args.database_url
    if url is None:
        node = PostgresNode(data_dir=ROOT / ".oncely" / "bench-completeness")
        node.start()
        url = node.url
    engine = sa.create_engine(url)
    try:
        _run(engine, args)
    finally:
        engine.dispose()
        if node is not None:
            node.stop()


def _run(engine: sa.Engine, args: argparse.Namespace) -> None:
    upgrade(engine)
    settings = CompletenessSettings()
    with engine.begin() as conn:
        now_ms = int(conn.execute(sa.text("SELECT extract(epoch FROM now()) * 1000")).scalar_one())
        # From 10 minutes after the window's start to 6 minutes ago (past the grace period).
        start_ms = now_ms - int(args.hours * 3600 * 1000) + 600_000
        step_ms = (now_ms - 360_000 - start_ms) / args.rows
        began = time.monotonic()
        conn.execute(sa.text("TRUNCATE oncely_outbox, oncely_receipts"))
        conn.execute(
            sa.text(_FILL),
            {"rows": args.rows, "types": args.types, "start_ms": start_ms, "step_ms": step_ms},
        )
        conn.execute(sa.text(_RECEIPTS), {"effect": EFFECT, "missing": args.missing})
    with engine.begin() as conn:  # after the rows' commit: the relay's progress passes them
        conn.execute(sa.text("UPDATE oncely_relay_shards SET done = pg_current_snapshot()"))
    print(f"filled {args.rows:,} rows in {time.monotonic() - began:.0f} s")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM (ANALYZE) oncely_outbox, oncely_receipts"))
    types = ["bench.type-0"]
    for n in range(args.repeat):
        began = time.monotonic()
        with engine.connect() as conn, conn.begin():
            result = check_effect(conn, effect=EFFECT, types=types, settings=settings)
        print(
            f"check {n + 1}: {time.monotonic() - began:.3f} s, {result.missing} missing,"
            f" {result.buckets} buckets, {result.buckets_read} read row by row"
        )
    with engine.connect() as conn, conn.begin():
        bounds = completeness_bounds(conn)
        span = window(bounds, settings)
        assert span is not None, "the rows are younger than the grace period"
        edges = [
            lowest_of_millis(ms)
            for ms in bucket_edges(*span, round(settings.bucket_seconds * 1000))
        ]
        params: dict[str, Any] = {
            "effect": EFFECT,
            "types": types,
            "lows": edges[:-1],
            "highs": edges[1:],
            "limit": settings.sample_size,
        }
        counts = bucket_counts(
            conn, effect=EFFECT, types=types, lows=params["lows"], highs=params["highs"]
        )
        read = disagreeing(counts)  # as the check does: only these are read row by row
        for name in ("completeness_buckets", "completeness_missing"):
            if name == "completeness_missing":
                params["lows"] = [params["lows"][n] for n in read]
                params["highs"] = [params["highs"][n] for n in read]
            plan = conn.execute(
                sa.text(f"EXPLAIN (ANALYZE, BUFFERS) {query(name).text}"), params
            ).scalars()
            print(f"\n-- {name}\n" + "\n".join(plan))


if __name__ == "__main__":
    main()
