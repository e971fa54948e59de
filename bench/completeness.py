"""R-COMPLETENESS: the cost of one completeness check on a large outbox.

Starts an embedded PostgreSQL under ``.oncely/bench-completeness/`` (or uses
``--completeness-database-url``, whose database it fills: give it an empty one), creates
oncely's tables, and fills them with SQL ``generate_series`` (fast): ``rows`` outbox rows
(``python -m bench``: 10,000,000 x BENCH_SCALE) staged evenly over the last ``hours`` (24: every
row is in the default 24-hour window, past the grace period), of ``types`` event types (the
effect consumes one of them), all published as far as the relay's progress says; the effect's
receipts for all but ``missing`` of its events. Then it vacuums and analyses the tables (as
autovacuum would, so that index-only scans skip the heap), runs the check
(:func:`oncely.consumers.completeness.check_effect`) ``repeat`` times, and returns its wall
times as a cell with ``EXPLAIN (ANALYZE, BUFFERS)`` of its two statements.

The check's cost grows with the rows in the window (the outbox rows are read for their type),
not with the table: a table holding a week with a 24-hour window costs about a seventh.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.harness import Cell, progress
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


def completeness_cell(
    *,
    database_url: str | None,
    rows: int,
    repeat: int,
    hours: float = 24.0,
    types: int = 4,
    missing: int = 5,
) -> tuple[Cell, dict[str, list[str]]]:
    """The check's wall time (seconds, one value per run: absolute, reported) and the plans of
    its two statements, by statement name."""
    node = None
    url = database_url
    if url is None:
        node = PostgresNode(data_dir=ROOT / ".oncely" / "bench-completeness")
        node.start()
        url = node.url
    engine = sa.create_engine(url)
    try:
        times, plans = _run(
            engine, rows=rows, hours=hours, types=types, missing=missing, repeat=repeat
        )
    finally:
        engine.dispose()
        if node is not None:
            node.stop()
    cell = Cell(
        "R-COMPLETENESS",
        "one check",
        [],
        "s",
        target="reported",
        measures=f"wall time of one completeness check (check_effect, default settings) over "
        f"{rows:,} outbox rows in its {hours:g}-hour window, {types} types, {missing} missing",
        notes=["EXPLAIN (ANALYZE, BUFFERS) of its two statements in the JSON's details"],
    )
    cell.rates = {cell.numerator: times}
    return cell, plans


def _run(
    engine: sa.Engine, *, rows: int, hours: float, types: int, missing: int, repeat: int
) -> tuple[list[float], dict[str, list[str]]]:
    upgrade(engine)
    settings = CompletenessSettings()
    with engine.begin() as conn:
        now_ms = int(conn.execute(sa.text("SELECT extract(epoch FROM now()) * 1000")).scalar_one())
        # From 10 minutes after the window's start to 6 minutes ago (past the grace period).
        start_ms = now_ms - int(hours * 3600 * 1000) + 600_000
        step_ms = (now_ms - 360_000 - start_ms) / rows
        began = time.monotonic()
        conn.execute(sa.text("TRUNCATE oncely_outbox, oncely_receipts"))
        conn.execute(
            sa.text(_FILL),
            {"rows": rows, "types": types, "start_ms": start_ms, "step_ms": step_ms},
        )
        conn.execute(sa.text(_RECEIPTS), {"effect": EFFECT, "missing": missing})
    with engine.begin() as conn:  # after the rows' commit: the relay's progress passes them
        conn.execute(sa.text("UPDATE oncely_relay_shards SET done = pg_current_snapshot()"))
    progress(f"filled {rows:,} rows in {time.monotonic() - began:.0f} s")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM (ANALYZE) oncely_outbox, oncely_receipts"))
    consumed = ["bench.type-0"]
    times = []
    for n in range(repeat):
        began = time.monotonic()
        with engine.connect() as conn, conn.begin():
            result = check_effect(conn, effect=EFFECT, types=consumed, settings=settings)
        times.append(time.monotonic() - began)
        progress(
            f"check {n + 1}: {times[-1]:.3f} s, {result.missing} missing,"
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
            "types": consumed,
            "lows": edges[:-1],
            "highs": edges[1:],
            "limit": settings.sample_size,
        }
        counts = bucket_counts(
            conn, effect=EFFECT, types=consumed, lows=params["lows"], highs=params["highs"]
        )
        read = disagreeing(counts)  # as the check does: only these are read row by row
        plans = {}
        for name in ("completeness_buckets", "completeness_missing"):
            if name == "completeness_missing":
                params["lows"] = [params["lows"][n] for n in read]
                params["highs"] = [params["highs"][n] for n in read]
            plan = conn.execute(
                sa.text(f"EXPLAIN (ANALYZE, BUFFERS) {query(name).text}"), params
            ).scalars()
            plans[name] = list(plan)
    return times, plans
