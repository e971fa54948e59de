"""R-IDLE and R-CIDLE: what an idle relay and an idle consumer cost, with nothing to do.

One ``oncely relay run`` process (the bench's relay settings, started as every relay cell
starts it: :func:`bench.fixtures.relay_processes`), ready and holding every shard, over an
empty outbox. After ``SETTLE_SECONDS``, ``repetitions`` windows of ``seconds`` each (60 s at
``BENCH_SCALE=1``, at least 10 s) in which nothing is staged and the bench process only sleeps:

- **R-IDLE cores** (target <= 0.01): CPU cores used over the window by the relay process plus
  every PostgreSQL server process (the postmaster and all its children: the relay's backends,
  checkpointer, walwriter, autovacuum, ...), from ``utime + stime`` of ``/proc/<pid>/stat``
  (:func:`bench.harness.cpu_window`; only this process's tree is counted, so another
  PostgreSQL on the machine is not). The broker's cores are reported beside it, as context.
- **R-IDLE queries** (target <= 1): statements per second the relay sends to PostgreSQL, the
  ``calls`` of ``pg_stat_statements`` (top-level statements, utility ones such as ``BEGIN``,
  ``COMMIT`` and ``LISTEN`` included). The relay connects as a role of its own, ``ROLE``
  (created by the cell), the only role whose statements are tracked: the bench's devstack
  preloads ``pg_stat_statements`` with ``pg_stat_statements.track=none`` (other cells pay
  nothing for it) and the cell sets ``track=top`` for ``ROLE`` alone. The five statements
  called most are in the run's details (``R-IDLE statements``) and the notes.

**R-CIDLE** (target <= 0.01): CPU cores of one ``oncely consume bench.effects_app:effects
--effect apply`` process (the consumer's defaults) with nothing to consume. A relay process
carries one sentinel event to it first (so the consumer is assigned its partitions and caught
up), then stops; after ``SETTLE_SECONDS``, ``repetitions`` windows of ``seconds`` each (60 s at
``BENCH_SCALE=1``) in which nothing is written: the consumer process's ``utime + stime`` from
``/proc/<pid>/stat`` over the window (:func:`bench.harness.cpu_window`), the broker's and
PostgreSQL's cores beside it as context.

Without ``pg_stat_statements`` loaded (services given by ``ONCELY_DATABASE_URL``), the count
falls back to the database's ``xact_commit + xact_rollback`` (``pg_stat_database``) over the
window, minus the bench's own reads: transactions, not statements, and anyone else's count
too; the cell's note says which was used.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.fixtures import (
    Bench,
    commit_at_once,
    delete_topic,
    metric,
    processes,
    relay_processes,
    restage,
    wait_ready,
)
from bench.harness import Cell, cpu_window, interleave
from bench.writers import effects_topic, outbox_rows

ROLE = "oncely_bench_idle"
SETTLE_SECONDS = 5.0
RELAY = "idle relay"
CONSUMER = "idle consumer"
#: What a PostgreSQL with the extension needs (the bench's devstack starts with these).
PG_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "none"}
#: The relay's and PostgreSQL's process classes (bench.harness).
COUNTED = ("relay", "postgres")


def _statements_loaded(bench: Bench) -> bool:
    with bench.engine.connect() as conn:
        preload = conn.execute(sa.text("SHOW shared_preload_libraries")).scalar_one()
    return "pg_stat_statements" in str(preload)


def _prepare_role(bench: Bench) -> str:
    """Create ``ROLE`` (a superuser, so the relay needs no grants), tracked by
    ``pg_stat_statements``; return the relay's database URL as that role."""
    with bench.engine.begin() as conn:
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        exists = conn.execute(
            sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": ROLE}
        ).first()
        if exists is None:
            conn.execute(sa.text(f"CREATE ROLE {ROLE} LOGIN SUPERUSER"))
        conn.execute(sa.text(f"ALTER ROLE {ROLE} SET pg_stat_statements.track = 'top'"))
    url = sa.make_url(bench.database_url).set(username=ROLE)
    return url.render_as_string(hide_password=False)


def _statement_calls(bench: Bench) -> list[tuple[str, int]]:
    """``(query, calls)`` of ``ROLE``'s statements since the last reset, most called first."""
    with bench.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT s.query, s.calls FROM pg_stat_statements s"
                " JOIN pg_roles r ON r.oid = s.userid WHERE r.rolname = :role"
                " ORDER BY s.calls DESC"
            ),
            {"role": ROLE},
        ).all()
    return [(str(query), int(calls)) for query, calls in rows]


def _reset_statements(bench: Bench) -> None:
    with bench.engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
        conn.commit()


def _transactions(bench: Bench) -> int:
    """Committed and rolled back transactions of the database so far (``pg_stat_database``),
    after asking the server to flush its statistics."""
    with bench.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sa.text(
                    "SELECT xact_commit + xact_rollback FROM pg_stat_database"
                    " WHERE datname = current_database()"
                )
            ).scalar_one()
        )


def idle_cells(
    bench: Bench, *, repetitions: int, seconds: float
) -> tuple[list[Cell], dict[str, Any]]:
    """R-IDLE cores and R-IDLE queries; the details hold every window's top statements."""
    tracked = _statements_loaded(bench)
    env = {"ONCELY_DATABASE_URL": _prepare_role(bench)} if tracked else {}
    restage(bench, [])
    windows: list[dict[str, Any]] = []

    def window() -> float:
        if tracked:
            _reset_statements(bench)
        else:
            before = _transactions(bench)
        with cpu_window() as cpu:
            time.sleep(seconds)
        if tracked:
            calls = _statement_calls(bench)
            queries = sum(n for _, n in calls) / cpu.seconds
            top = [
                {"calls": n, "per_second": round(n / cpu.seconds, 3), "query": q} for q, n in calls
            ]
        else:
            # The two reads of this window are the bench's own transactions.
            queries = (_transactions(bench) - before - 2) / cpu.seconds
            top = []
        cores = {kind: round(cpu.cores.get(kind, 0.0), 4) for kind in (*COUNTED, "broker")}
        windows.append(
            {
                "seconds": round(cpu.seconds, 1),
                "cores": cores,
                "queries_per_second": round(queries, 3),
                "statements": top,
            }
        )
        return sum(cpu.cores.get(kind, 0.0) for kind in COUNTED)

    with relay_processes(bench, 1, env=env):
        time.sleep(SETTLE_SECONDS)
        run = interleave({RELAY: window}, repetitions=repetitions, warmup=False)
    source = (
        f"pg_stat_statements calls of the relay's own role {ROLE} (top-level statements, "
        "utility ones included)"
        if tracked
        else "pg_stat_database xact_commit + xact_rollback minus the bench's reads "
        "(transactions, not statements: pg_stat_statements is not preloaded)"
    )
    window_note = (
        f"one relay process over an empty outbox, {repetitions} windows of {seconds:.0f} s "
        f"after {SETTLE_SECONDS:.0f} s of settling; nothing staged"
    )
    cores_cell = Cell(
        "R-IDLE cores",
        RELAY,
        [],
        "cores",
        target="<= 0.01",
        measures="CPU cores used by an idle relay process plus every PostgreSQL process, "
        "nothing staged",
        notes=[window_note],
    )
    cores_cell.take(run)
    med = {k: statistics.median(w["cores"][k] for w in windows) for k in (*COUNTED, "broker")}
    cores_cell.summary = (
        f"relay {med['relay']:.4f} + PostgreSQL {med['postgres']:.4f} cores "
        f"(broker {med['broker']:.4f}, context)"
    )
    queries_cell = Cell(
        "R-IDLE queries",
        RELAY,
        [],
        "queries/s",
        target="<= 1",
        measures="queries per second an idle relay sends to PostgreSQL, nothing staged",
        notes=[window_note, f"counted: {source}"],
    )
    queries_cell.take(run, values={RELAY: [w["queries_per_second"] for w in windows]})
    last = windows[-1]["statements"][:5]
    if last:
        queries_cell.notes.append(
            "top statements of the last window (per second): "
            + "; ".join(f"{s['per_second']}/s `{' '.join(s['query'].split())[:120]}`" for s in last)
        )
    return [cores_cell, queries_cell], {"source": source, "windows": windows}


def consumer_idle_cell(
    bench: Bench, *, repetitions: int, seconds: float
) -> tuple[Cell, dict[str, Any]]:
    """R-CIDLE: an idle consumer process's cores; the details hold every window's cores."""
    prefix = f"cidle-{uuid.uuid4().hex[:6]}."
    topic = effects_topic(bench, prefix)
    [sentinel] = outbox_rows(prefix, 1, keys=1)
    restage(bench, [])
    env = {
        "ONCELY_DATABASE_URL": bench.database_url,
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bench.bootstrap,
        "ONCELY_BENCH_TOPIC_PREFIX": prefix,
        "ONCELY_BENCH_GROUP_PREFIX": prefix,
    }
    windows: list[dict[str, Any]] = []
    argv = ["consume", "bench.effects_app:effects", "--effect", "apply"]
    with processes(argv, 1, env) as [consumer]:
        wait_ready([consumer])
        with relay_processes(bench, 1):
            commit_at_once(bench, [sentinel], topic)
            deadline = time.monotonic() + 120
            while metric(consumer, "oncely_consumer_applied_total", effect="apply") < 1:
                if time.monotonic() > deadline or consumer.proc.poll() is not None:
                    raise RuntimeError(f"the sentinel was not applied (see {consumer.log})")
                time.sleep(0.05)
        time.sleep(SETTLE_SECONDS)

        def window() -> float:
            with cpu_window() as cpu:
                time.sleep(seconds)
            mine = sum(
                cores
                for pid, (kind, cores) in cpu.by_pid.items()
                if kind == "consumer" and pid == consumer.proc.pid
            )
            cores = {kind: round(cpu.cores.get(kind, 0.0), 4) for kind in ("broker", "postgres")}
            windows.append({"seconds": round(cpu.seconds, 1), "consumer": round(mine, 4), **cores})
            return mine

        run = interleave({CONSUMER: window}, repetitions=repetitions, warmup=False)
    delete_topic(bench, topic)
    cell = Cell(
        "R-CIDLE",
        CONSUMER,
        [],
        "cores",
        target="<= 0.01",
        measures="CPU cores used by an idle `oncely consume` process (assigned, caught up), "
        "nothing to consume",
        notes=[
            f"one consumer process (defaults, {bench.partitions} partitions), one sentinel event "
            f"applied through a relay that then stops; {repetitions} windows of {seconds:.0f} s "
            f"after {SETTLE_SECONDS:.0f} s of settling; the process's utime + stime from "
            "/proc/<pid>/stat"
        ],
    )
    cell.take(run)
    med = {k: statistics.median(w[k] for w in windows) for k in ("consumer", "broker", "postgres")}
    cell.summary = (
        f"consumer {med['consumer']:.4f} cores (broker {med['broker']:.4f}, PostgreSQL "
        f"{med['postgres']:.4f}, context)"
    )
    return cell, {"windows": windows}
