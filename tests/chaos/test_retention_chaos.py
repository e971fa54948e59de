"""S15 and S16: partitioned retention under what the field does to it (issue 45).

- **S15**: a writer whose clock is off by more than a step (1-minute steps) stages while a
  writer with the right clock, a relay, a consumer and retention (every 3 s, horizons 0, 2
  steps ahead) run. Ahead by 3 minutes, its event ids fall in steps that have no partition
  yet (but in its first minute, which the conversion's 3 steps ahead still cover); behind by
  90 s, in steps that are over, whose outbox partitions retention drops while it stages or has
  dropped (and, in its first minute, before the first partition).
- **S16**: the tables are converted to partitions (``oncely db upgrade --partition-every 1m``)
  while two relays (batched DELETE every 2 s) and a writer run; no Job runs retention, so the
  relays must take it over (F6).

The end state checked, besides the ledger (0 lost, 0 duplicate effects, per-key order):

- no staging failed (a writer with an old id can deadlock with a drop: F10);
- retention raised nothing but refusals (the harness's check);
- retention settles once the writers stop: every step from the current one to ``ahead`` steps
  after it has its partition in both tables, no outbox partition older than the previous step
  is left (horizon 0, every row published), and neither default partition holds a row of a
  step already covered (one that a range partition exists or could exist for now): nothing is
  stranded in ``_default`` (F5).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from oncely import ids
from oncely.storage import partitions
from tests.apps.ledger import App, create_tables
from tests.chaos.harness import POLICY, STEP, Pipeline, Proc, Retention, convert, pipeline
from tests.chaos.ledger import check
from tests.chaos.skewed_clock import SKEW_ENV
from tests.chaos.skewed_writer import KEY_PREFIX

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

TABLES = ("oncely_outbox", "oncely_receipts")
KEYS = {"oncely_outbox": "id", "oncely_receipts": "event_id"}
#: Ahead by three steps: past the partitions retention keeps ahead (``POLICY.ahead`` 2), so
#: every row of the writer is staged into a step with no partition yet.
AHEAD_SKEW = 3 * STEP.total_seconds()
#: Behind by a step and a half: into steps that are over, whose outbox partitions retention
#: drops (horizon 0) while the writer stages into them, or has dropped.
BEHIND_SKEW = -1.5 * STEP.total_seconds()
#: How long the skewed writer stages: past a minute boundary, so that partitions are created
#: and dropped meanwhile; behind, long enough that its ids reach steps that had partitions.
WRITE_SECONDS = {AHEAD_SKEW: 60, BEHIND_SKEW: 120}


def _writes_failed(proc: Proc) -> list[str]:
    return [
        line
        for line in proc.log.read_text(errors="replace").splitlines()
        if line.startswith("staging failed")
    ]


def _ahead_offsets(chaos: Pipeline) -> list[float]:
    """Seconds by which each skewed writer's event id is ahead of its row's ``created_at``."""
    with chaos.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, created_at FROM chaos_outbox WHERE aggregateid LIKE :p"),
            {"p": f"{KEY_PREFIX}%"},
        ).all()
    return [(ids.moment_of(r.id) - r.created_at).total_seconds() for r in rows]


def _in_default(chaos: Pipeline) -> dict[str, int]:
    return {t: chaos.count(f"SELECT count(*) FROM {t}_default") for t in TABLES}


def _unsettled(engine: sa.Engine, ahead: int) -> list[str]:
    """What keeps retention from its settled state now (empty: settled)."""
    problems = []
    with engine.connect() as conn:
        now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        current = partitions.window_start(now, STEP)
        covered = ids.lowest_of(current + (ahead + 1) * STEP)
        for table in TABLES:
            found = partitions.partitions(conn, table)
            names = {p.name for p in found}
            missing = [
                partitions.partition_name(table, current + n * STEP)
                for n in range(ahead + 1)
                if partitions.partition_name(table, current + n * STEP) not in names
            ]
            if missing:
                problems.append(f"{table}: no partition {', '.join(missing)}")
            # Receipts of steps that are over stay while Kafka holds their records (in the
            # harness, for ever): only those of the steps that have partitions now count.
            since = ids.lowest_of(current) if table == "oncely_receipts" else None
            stranded = conn.execute(
                sa.text(
                    f"SELECT count(*) FROM {table}_default WHERE {KEYS[table]} < :covered"
                    f" AND (CAST(:since AS uuid) IS NULL OR {KEYS[table]} >= :since)"
                ),
                {"covered": covered, "since": since},
            ).scalar_one()
            if stranded:
                problems.append(f"{table}_default: {stranded} row(s) of steps before {covered}")
        stale = [
            p.name
            for p in partitions.partitions(conn, "oncely_outbox")
            if p.upper is not None and p.upper < current
        ]
        if stale:
            problems.append(f"oncely_outbox: partitions not dropped: {', '.join(stale)}")
    return problems


def _settled(
    chaos: Pipeline,
    keeper: Retention | None,
    ahead: int,
    *,
    after: datetime | None = None,
    timeout: float = 60,
) -> float:
    """Wait until the database's clock is past ``after`` and retention has settled
    (:func:`_unsettled`) within ``timeout`` seconds more; return the seconds waited. Fails at
    once when retention reports a failure (say, a creation refused)."""
    started = time.monotonic()
    if after is not None:
        with chaos.engine.connect() as conn:
            now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        time.sleep(max(0.0, (after - now).total_seconds()))
    waited = time.monotonic()
    while True:
        problems = _unsettled(chaos.engine, ahead)
        if not problems:
            return time.monotonic() - started
        failures = keeper.failures if keeper is not None else []
        if failures or time.monotonic() - waited > timeout:
            raise AssertionError(
                f"retention did not settle in {time.monotonic() - started:.0f} s: "
                f"{'; '.join(problems)}; retention failures: {failures[:3]}; "
                f"rows in the default partitions: {_in_default(chaos)}"
            )
        time.sleep(1)


def _last_skewed_step(chaos: Pipeline) -> datetime:
    """The step of the skewed writer's latest event id."""
    with chaos.engine.connect() as conn:
        last = conn.execute(
            sa.text(
                "SELECT id FROM chaos_outbox WHERE aggregateid LIKE :p ORDER BY id DESC LIMIT 1"
            ),
            {"p": f"{KEY_PREFIX}%"},
        ).scalar_one()
    return partitions.window_start(ids.moment_of(last), STEP)


@pytest.mark.parametrize("skew", [AHEAD_SKEW, BEHIND_SKEW], ids=["ahead", "behind"])
def test_s15_a_writer_whose_clock_is_off_by_more_than_a_step(chaos: Pipeline, skew: float) -> None:
    started = time.monotonic()
    chaos.consumer().start()
    chaos.relay().start()
    writer = Proc(
        [str(WRITE_SECONDS[skew])],
        chaos.env(),
        chaos.log_dir / "skewed-writer.log",
        module="tests.chaos.skewed_writer",
    )
    chaos.procs.append(writer)
    stop = threading.Event()
    writer.start(**{SKEW_ENV: str(skew)})
    local = chaos.write_until(stop, keys=20)
    try:
        assert writer.wait(WRITE_SECONDS[skew] + 180) == 0, chaos.logs()
    finally:
        stop.set()
        local.join(60)
    written = time.monotonic()
    in_default = _in_default(chaos)
    drain = chaos.wait_applied(chaos.staged(), timeout=300)
    offsets = _ahead_offsets(chaos)
    failed = _writes_failed(writer)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    keeper = chaos.retention
    assert keeper is not None
    print(
        f"S15 skew={skew:+.0f}s skewed_rows={len(offsets)} "
        f"median_id_ahead_of_created_at={statistics.median(offsets) if offsets else 0:.0f}s "
        f"in_default_after_writing={in_default} drain={drain:.1f}s "
        f"staging_failed={len(failed)} {keeper.summary()} {report.summary()}"
    )
    assert offsets and abs(statistics.median(offsets) - skew) < 30, "the writer was not skewed"
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert not failed, f"{len(failed)} staging(s) failed: {failed[:3]}"
    # Wait until retention has had the skewed rows' last step within its reach (ahead) for a
    # few runs, or at once (behind: their steps are over).
    reach = _last_skewed_step(chaos) - POLICY.ahead * STEP + timedelta(seconds=10)
    settle = _settled(chaos, keeper, POLICY.ahead, after=reach)
    print(
        f"S15 skew={skew:+.0f}s settled {settle:.1f}s after the drain; "
        f"writing={written - started:.0f}s {keeper.summary()}"
    )


@pytest.fixture
def unpartitioned(
    database_url: str, kafka_bootstrap: str, app: App, tmp_path: Path
) -> Iterator[Pipeline]:
    """The pipeline on unpartitioned tables, and no retention run but the relays' own."""
    engine = sa.create_engine(database_url, pool_size=5)
    create_tables(engine)
    try:
        with pipeline(
            engine,
            database_url,
            kafka_bootstrap,
            app,
            tmp_path,
            partition_every=None,
            retention_every=24 * 3600,
        ) as running:
            yield running
    finally:
        engine.dispose()


#: The relays' retention: horizons 0 as the harness's, and 5 steps ahead, more than the
#: conversion's 3, so that partitions created after it show the relays run retention.
RELAY_AHEAD = 5
RELAY_RETENTION = {
    "ONCELY_RELAY_PURGE_INTERVAL_SECONDS": "2",
    "ONCELY_RELAY_RETENTION_SECONDS": "0",
    "ONCELY_RETENTION_RECEIPTS_HORIZON_SECONDS": "0",
    "ONCELY_RETENTION_AHEAD": str(RELAY_AHEAD),
}


def _retention_gauges(relay: Proc) -> dict[str, float]:
    try:
        return {k: v for k, v in relay.metrics().items() if k.startswith("oncely_retention_")}
    except OSError:
        return {}


def _wait(what: str, ok: Any, timeout: float, chaos: Pipeline) -> float:
    started = time.monotonic()
    while not ok():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not seen in {timeout} s\n{chaos.logs()}")
        time.sleep(0.5)
    return time.monotonic() - started


def test_s16_converting_to_partitions_while_relays_run(unpartitioned: Pipeline) -> None:
    chaos = unpartitioned
    chaos.consumer().start()
    relays = {
        name: chaos.relay(name, metrics=True).start(ONCELY_RELAY_RELAY_ID=name, **RELAY_RETENTION)
        for name in ("r0", "r1")
    }
    stop = threading.Event()
    writer = chaos.write_until(stop, keys=20)
    try:
        for relay in relays.values():
            _wait("a relay publishes", lambda r=relay: r.published() > 0, 60, chaos)
        # The relays purge the unpartitioned outbox by batched DELETE meanwhile.
        _wait(
            "the batched DELETE",
            lambda: chaos.count("SELECT count(*) FROM oncely_outbox") < chaos.staged(),
            60,
            chaos,
        )
        for relay in relays.values():  # unpartitioned: no retention gauges (the counters are 0)
            assert "oncely_retention_partitions" not in _retention_gauges(relay)
        paused = time.monotonic()
        convert(chaos.engine)  # oncely db upgrade --partition-every 1m
        pause = time.monotonic() - paused
        with chaos.engine.connect() as conn:
            converted_at: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        farthest = partitions.partition_name(
            "oncely_outbox", partitions.window_start(converted_at, STEP) + RELAY_AHEAD * STEP
        )
        took = {
            name: _wait(
                f"{name} exports the retention gauges",
                lambda r=relay: _retention_gauges(r).get("oncely_retention_partitions", 0) > 0,
                60,
                chaos,
            )
            for name, relay in relays.items()
        }
        ahead = _wait(
            f"a relay creates {farthest}",
            lambda: chaos.count(f"SELECT count(*) FROM to_regclass('{farthest}')") == 1,
            60,
            chaos,
        )
        # Write on past the next minute boundary: the relays drop what has passed.
        time.sleep(max(0.0, 75 - (time.monotonic() - paused)))
    finally:
        stop.set()
        writer.join(60)
    drain = chaos.wait_applied(chaos.staged(), timeout=300)
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    gauges = {name: _retention_gauges(r) for name, r in relays.items()}
    dropped = sum(g.get("oncely_retention_dropped_partitions_total", 0) for g in gauges.values())
    errors = sum(g.get("oncely_retention_errors_total", 0) for g in gauges.values())
    print(
        f"S16 conversion_pause={pause:.2f}s gauges_after="
        f"{','.join(f'{n}:{t:.1f}s' for n, t in took.items())} created_ahead_after={ahead:.1f}s "
        f"relay_dropped={dropped:.0f} relay_retention_errors={errors:.0f} "
        f"in_default={_in_default(chaos)} drain={drain:.1f}s {report.summary()}"
    )
    assert all(relay.alive() for relay in relays.values()), chaos.logs()
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert dropped > 0, "the relays dropped no partition after the conversion"
    assert errors == 0, gauges
    settle = _settled(chaos, None, RELAY_AHEAD)
    print(f"S16 settled {settle:.1f}s after the drain")
