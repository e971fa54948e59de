"""S13: relays on hosts whose clocks are two hours off: leases and delays use the database clock.

Every time the relay's statements store or compare (a shard's ``lease_until``, a member's
``heartbeat_until``, whether a row's ``available_at`` has come) comes from PostgreSQL's
``now()``: the relay sends only durations (``lease_seconds``), never a time of its own host
(``storage/sql/outbox.sql``, ``storage/stores/outbox/relay.py``; a record's Kafka timestamp is the
row's ``created_at``; retry backoffs are timed on the monotonic clock, which a skewed host keeps).
The host clock is read only for the publish-latency metric. These scenarios run relays whose
Python wall clock is moved by +2 h or -2 h (``tests/chaos/skewed_clock.py``) and check that:

- a shard lease taken by a skewed relay ends ``lease_seconds`` after the database's ``now()``,
  and a relay skewed the other way takes the shard over when the database says it expired: not
  before (as a clock ahead would), not hours later (as a clock behind would);
- a delayed row (``available_at`` ahead) is published when the database clock says it is due;
- under load, with the two skewed relays paused in turn past their leases, no lease is ever
  longer than ``lease_seconds`` from the database's ``now()`` nor held hours after it expired,
  and the ledger holds: 0 lost, 0 duplicate effects, per-key order.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests.chaos.harness import Pipeline, Proc
from tests.chaos.ledger import check
from tests.chaos.skewed_clock import SKEW_ENV
from tests.helpers import insert_rows, outbox_rows

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

SKEWED = "tests.chaos.skewed_clock"
HOURS_2 = 2 * 3600.0
#: How late after the database says a lease expired (or a row is due) a relay may act on it,
#: besides its lease tick (a third of the lease): a busy two-core machine.
CLAIM_SLACK = 3.0


def _skewed_relay(chaos: Pipeline, name: str, skew: float, **env: str) -> Proc:
    proc = chaos.relay(name, module=SKEWED, metrics=True)
    return proc.start(**{SKEW_ENV: str(skew), "ONCELY_RELAY_RELAY_ID": name, **env})


def _logged_skew(proc: Proc, timeout: float = 60) -> float:
    """The skew the relay's own log shows: its "relay started" line's time minus ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.endswith("relay started"):
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                return (stamp - datetime.now()).total_seconds()
        time.sleep(0.2)
    raise AssertionError(f"{proc.log.name}: no 'relay started' line after {timeout} s")


def _shard(chaos: Pipeline, shard: int) -> sa.Row[Any]:
    with chaos.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT owner, epoch, lease_until, now() AS db_now FROM oncely_relay_shards"
                " WHERE shard = :shard"
            ),
            {"shard": shard},
        ).one()


def _wait_shard(
    chaos: Pipeline, shard: int, what: str, ok: Any, timeout: float = 90
) -> sa.Row[Any]:
    deadline = time.monotonic() + timeout
    while True:
        row = _shard(chaos, shard)
        if ok(row):
            return row
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {timeout} s; last {row}\n{chaos.logs()}")
        time.sleep(0.05)


def _one_row_shard(chaos: Pipeline) -> int:
    return chaos.count("SELECT shard FROM chaos_outbox")


@pytest.mark.parametrize(
    ("holder_skew", "taker_skew"),
    [(HOURS_2, -HOURS_2), (-HOURS_2, HOURS_2)],
    ids=["ahead-holds-behind-takes-over", "behind-holds-ahead-takes-over"],
)
def test_s13_a_lease_is_timed_by_the_database_clock(
    chaos: Pipeline, holder_skew: float, taker_skew: float
) -> None:
    lease = 20.0
    chaos.write(1, keys=1)
    shard = _one_row_shard(chaos)
    # Each relay leaves right after it took the shards and read the row (nothing produced),
    # so the lease it took stays to be read, and the row to be read again by the next one.
    crash_after_read = {
        "ONCELY_RELAY_LEASE_SECONDS": str(lease),
        "ONCELY_FAILPOINTS": "relay.after_read=exit",
    }
    holder = _skewed_relay(chaos, "holder", holder_skew, **crash_after_read)
    assert holder.wait(90) == 137, chaos.logs()
    assert abs(_logged_skew(holder) - holder_skew) < 120, "the holder's clock was not skewed"
    held = _wait_shard(chaos, shard, "the holder's lease", lambda r: r.owner == "holder")
    remaining = (held.lease_until - held.db_now).total_seconds()
    # Computed from the database's now() at the lease: at most lease_seconds ahead of it.
    assert 0 < remaining <= lease, f"lease_until is {remaining:.1f} s from the database's now()"

    taker = _skewed_relay(chaos, "taker", taker_skew, **crash_after_read)
    assert abs(_logged_skew(taker) - taker_skew) < 120, "the taker's clock was not skewed"
    assert _shard(chaos, shard).db_now < held.lease_until, (
        "inconclusive: the taker started after the lease had expired (a slow machine?)"
    )
    taken = _wait_shard(
        chaos, shard, "the taker's lease", lambda r: r.owner == "taker", timeout=lease + 60
    )
    assert taker.wait(30) == 137, chaos.logs()
    leased_at = taken.lease_until - timedelta(seconds=lease)  # the taker's lease, DB clock
    late = (leased_at - held.lease_until).total_seconds()
    print(
        f"S13 lease holder_skew={holder_skew:+.0f}s taker_skew={taker_skew:+.0f}s "
        f"lease={lease:.0f}s first_lease_remaining={remaining:.2f}s "
        f"taken_over_after_expiry={late:.2f}s"
    )
    assert taken.epoch == held.epoch + 1, "a takeover bumps the shard's epoch"
    # The taker looks for free shards at each lease tick, every third of the lease.
    assert 0 <= late <= lease / 3 + CLAIM_SLACK, f"taken over {late:.2f} s after it expired"


@pytest.mark.parametrize("skew", [HOURS_2, -HOURS_2], ids=["ahead", "behind"])
def test_s13_a_delayed_row_is_published_when_the_database_clock_says_it_is_due(
    chaos: Pipeline, skew: float
) -> None:
    delay = 10.0
    with chaos.engine.connect() as conn:
        db_now = conn.execute(sa.text("SELECT now()")).scalar_one()
    [row] = outbox_rows(1, topics=[chaos.app.topic], keys=1)
    due = db_now + timedelta(seconds=delay)
    insert_rows(chaos.engine, [{**row, "available_at": due}])
    relay = _skewed_relay(chaos, "relay", skew)
    assert abs(_logged_skew(relay) - skew) < 120, "the relay's clock was not skewed"
    parked = "SELECT count(*) FROM oncely_relay_parked WHERE reason = 'delayed' AND until = :due"
    with chaos.engine.connect() as conn:
        seen_parked = False
        while True:
            published = chaos.published()
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            conn.commit()
            if published:
                break
            seen_parked = seen_parked or bool(
                conn.execute(sa.text(parked), {"due": due}).scalar_one()
            )
            assert (now - due).total_seconds() < 60, f"not published\n{chaos.logs()}"
            time.sleep(0.05)
    late = (now - due).total_seconds()
    print(f"S13 delayed skew={skew:+.0f}s delay={delay:.0f}s published_after_due={late:.2f}s")
    assert seen_parked, "the relay never parked the key of the delayed row"
    # Due rows are found at each lease tick (a third of the harness's 3 s lease).
    assert 0 <= late <= 1.0 + CLAIM_SLACK, f"published {late:.2f} s after the row was due"
    assert relay.alive()


class _LeaseWatch:
    """Samples every shard lease held against the database clock, on a thread."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.samples = 0
        self.longest = 0.0  # max(lease_until - now())
        self.shortest = float("inf")  # min(lease_until - now()): expired, not yet taken over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        statement = sa.text(
            "SELECT count(*) AS leased,"
            " EXTRACT(EPOCH FROM max(lease_until - now())) AS longest,"
            " EXTRACT(EPOCH FROM min(lease_until - now())) AS shortest"
            " FROM oncely_relay_shards WHERE owner IS NOT NULL"
        )
        while not self._stop.wait(0.2):
            with self.engine.connect() as conn:
                row = conn.execute(statement).one()
            if row.leased:
                self.samples += 1
                self.longest = max(self.longest, float(row.longest))
                self.shortest = min(self.shortest, float(row.shortest))


def _mean_latency(metrics: dict[str, float]) -> float:
    """The relay's publish latency metric: created_at (database) to ack (host clock)."""
    count = metrics["oncely_relay_publish_latency_seconds_count"]
    return metrics["oncely_relay_publish_latency_seconds_sum"] / max(1.0, count)


def test_s13_two_relays_skewed_both_ways_share_the_outbox_under_load(chaos: Pipeline) -> None:
    lease = 3.0  # the harness's ONCELY_RELAY_LEASE_SECONDS
    consumer = chaos.consumer().start()
    # Some linger keeps rows in flight, so a pause catches pages to replay.
    relays = {
        name: _skewed_relay(chaos, name, skew, ONCELY_RELAY_LINGER_MS="300")
        for name, skew in (("ahead", HOURS_2), ("behind", -HOURS_2))
    }
    for name, relay in relays.items():
        assert abs(_logged_skew(relay) - (HOURS_2 if name == "ahead" else -HOURS_2)) < 120
    stop = threading.Event()
    with _LeaseWatch(chaos.engine) as watch:
        writer = chaos.write_until(stop, keys=50)
        try:
            for pause in range(6):  # each relay is paused past its lease three times
                time.sleep(3)
                paused = relays["ahead" if pause % 2 == 0 else "behind"]
                paused.kill(signal.SIGSTOP)
                time.sleep(lease + 2)
                paused.kill(signal.SIGCONT)
                resumed = time.monotonic()
        finally:
            stop.set()
            writer.join(60)
        chaos.wait_applied(chaos.staged(), timeout=300)
        recovery = time.monotonic() - resumed  # since the last pause ended
    assert all(relay.alive() for relay in relays.values()), chaos.logs()
    metrics = {name: relay.metrics() for name, relay in relays.items()}
    rss = {name: relay.peak_rss_mb() for name, relay in relays.items()}
    consumer_rss = consumer.peak_rss_mb()
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    per_relay = " ".join(
        f"{name}_published={m['oncely_relay_published_total']:.0f}"
        f" {name}_lease_lost={m['oncely_relay_lease_lost_total']:.0f}"
        f" {name}_progress_refused={m['oncely_relay_progress_refused_total']:.0f}"
        f" {name}_latency_metric_mean_s={_mean_latency(m):.0f}"
        f" {name}_peak_rss_mb={rss[name]:.0f}"
        for name, m in metrics.items()
    )
    print(
        f"S13 events={report.committed} recovery={recovery:.1f}s {per_relay} "
        f"consumer_peak_rss_mb={consumer_rss:.0f} lease_samples={watch.samples} "
        f"longest_lease_ahead_of_db_now={watch.longest:.2f}s "
        f"most_expired_lease_still_held={-watch.shortest:.2f}s {report.summary()}"
    )
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert all(m["oncely_relay_published_total"] > 0 for m in metrics.values()), per_relay
    assert watch.samples > 0
    assert watch.longest <= lease + 1.0, "a lease ran past lease_seconds from the DB's now()"
    # A paused relay's shards stay leased to it until the other relay's next tick after expiry
    # (a third of the lease); a lease timed by a clock 2 h behind would be hours in the past.
    assert watch.shortest >= -(2 + lease / 3 + CLAIM_SLACK), "an expired lease was not taken"
