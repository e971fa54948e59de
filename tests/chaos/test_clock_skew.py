"""S13: relays on hosts whose clocks are two hours off: leases use the database clock.

Every time the relay's statements store or compare (``lease_until``, ``available_at`` after a
backoff, ``published_at``) comes from PostgreSQL's ``now()``: the relay sends only durations
(``lease_seconds``, a backoff delay), never a time of its own host (``storage/sql/outbox.sql``,
``relay/store.py``; a record's Kafka timestamp is the row's ``created_at``). The host clock is
read only for the publish-latency metric. These scenarios run relays whose Python wall clock is
moved by +2 h or -2 h (``tests/chaos/skewed_clock.py``) and check that:

- a lease taken by a skewed relay ends ``lease_seconds`` after the database's ``now()``, and a
  relay skewed the other way takes the row over when the database says it expired: not before
  (as a clock ahead would), not hours later (as a clock behind would);
- a failed row's backoff is also timed by the database: it is claimed again when its
  ``available_at`` passes on the database clock;
- under load, with the two skewed relays paused in turn past their leases, no lease is ever
  longer than ``lease_seconds`` from the database's ``now()`` nor older than its row, and the
  ledger holds: 0 lost, 0 duplicate effects, per-key order.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from oncely.devstack._process import free_ports
from tests.chaos.harness import Pipeline, Proc
from tests.chaos.ledger import check
from tests.chaos.skewed_clock import SKEW_ENV
from tests.helpers import insert_rows, outbox_rows

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

SKEWED = "tests.chaos.skewed_clock"
HOURS_2 = 2 * 3600.0
#: How late after the database says a lease expired (or a row is due) a polling relay may
#: claim it: its idle poll is 0.2 s; the rest is a busy two-core machine.
CLAIM_SLACK = 3.0


def _skewed_relay(chaos: Pipeline, name: str, skew: float, **env: str) -> Proc:
    proc = chaos.relay(name, module=SKEWED)
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


def _row(chaos: Pipeline) -> sa.Row[Any]:
    with chaos.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT lease_owner, lease_until, available_at, attempts, status, last_error,"
                " created_at, now() AS db_now FROM oncely_outbox"
            )
        ).one()


def _wait_row(chaos: Pipeline, what: str, ok: Any, timeout: float = 90) -> sa.Row[Any]:
    deadline = time.monotonic() + timeout
    while True:
        row = _row(chaos)
        if ok(row):
            return row
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {timeout} s; last {row}\n{chaos.logs()}")
        time.sleep(0.05)


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
    # Each relay leaves right after its claim is committed, so the lease stays to be read.
    crash_after_claim = {
        "ONCELY_RELAY_LEASE_SECONDS": str(lease),
        "ONCELY_FAILPOINTS": "relay.after_claim=exit",
    }
    holder = _skewed_relay(chaos, "holder", holder_skew, **crash_after_claim)
    assert holder.wait(90) == 137, chaos.logs()
    assert abs(_logged_skew(holder) - holder_skew) < 120, "the holder's clock was not skewed"
    held = _wait_row(chaos, "the holder's lease", lambda r: r.lease_owner == "holder")
    assert held.attempts == 1
    remaining = (held.lease_until - held.db_now).total_seconds()
    # Computed from the database's now() at the claim: at most lease_seconds ahead of it.
    assert 0 < remaining <= lease, f"lease_until is {remaining:.1f} s from the database's now()"

    taker = _skewed_relay(chaos, "taker", taker_skew, **crash_after_claim)
    assert abs(_logged_skew(taker) - taker_skew) < 120, "the taker's clock was not skewed"
    assert _row(chaos).db_now < held.lease_until, (
        "inconclusive: the taker started after the lease had expired (a slow machine?)"
    )
    taken = _wait_row(
        chaos,
        "the taker's claim",
        lambda r: r.lease_owner == "taker",
        timeout=lease + 60,
    )
    assert taker.wait(30) == 137, chaos.logs()
    claimed_at = taken.lease_until - timedelta(seconds=lease)  # the taker's claim, DB clock
    late = (claimed_at - held.lease_until).total_seconds()
    print(
        f"S13 lease holder_skew={holder_skew:+.0f}s taker_skew={taker_skew:+.0f}s "
        f"lease={lease:.0f}s first_lease_remaining={remaining:.2f}s "
        f"taken_over_after_expiry={late:.2f}s"
    )
    assert taken.attempts == 2
    assert 0 <= late <= CLAIM_SLACK, f"taken over {late:.2f} s after the lease expired"


@pytest.mark.parametrize("skew", [HOURS_2, -HOURS_2], ids=["ahead", "behind"])
def test_s13_a_failed_rows_backoff_is_timed_by_the_database_clock(
    chaos: Pipeline, skew: float
) -> None:
    lease, base = 30.0, 20.0  # the first retry waits 10 to 20 s
    # A topic that does not exist: every delivery times out (message.timeout.ms 5 s).
    insert_rows(chaos.engine, outbox_rows(1, topics=[f"{chaos.app.topic}.missing"], keys=1))
    relay = _skewed_relay(
        chaos,
        "relay",
        skew,
        ONCELY_RELAY_LEASE_SECONDS=str(lease),
        ONCELY_RELAY_BACKOFF_BASE_SECONDS=str(base),
        ONCELY_RELAY_BACKOFF_MAX_SECONDS=str(base),
    )
    assert abs(_logged_skew(relay) - skew) < 120, "the relay's clock was not skewed"
    failed = _wait_row(
        chaos, "the first failure", lambda r: r.attempts == 1 and r.last_error is not None
    )
    assert failed.lease_owner is None and failed.status == "pending"
    backoff = (failed.available_at - failed.db_now).total_seconds()
    assert 0 < backoff <= base, f"available_at is {backoff:.1f} s from the database's now()"
    retried = _wait_row(
        chaos, "the retry's claim", lambda r: r.attempts == 2 and r.lease_owner == "relay"
    )
    claimed_at = retried.lease_until - timedelta(seconds=lease)
    late = (claimed_at - failed.available_at).total_seconds()
    print(
        f"S13 backoff skew={skew:+.0f}s backoff={backoff:.2f}s "
        f"retried_after_available={late:.2f}s error={failed.last_error[:60]!r}"
    )
    assert 0 <= late <= CLAIM_SLACK, f"retried {late:.2f} s after the row was due"
    assert relay.alive()


class _LeaseWatch:
    """Samples every leased row's lease against the database clock, on a thread."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.samples = 0
        self.longest = 0.0  # max(lease_until - now())
        self.earliest = float("inf")  # min(lease_until - created_at)
        self.latest_due = 0.0  # max(available_at - now())
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
            "SELECT count(*) FILTER (WHERE lease_owner IS NOT NULL) AS leased,"
            " EXTRACT(EPOCH FROM max(lease_until - now())) AS longest,"
            " EXTRACT(EPOCH FROM min(lease_until - created_at)) AS earliest,"
            " EXTRACT(EPOCH FROM max(available_at - now())) AS latest_due"
            " FROM oncely_outbox WHERE status = 'pending'"
        )
        while not self._stop.wait(0.2):
            with self.engine.connect() as conn:
                row = conn.execute(statement).one()
            if row.leased:
                self.samples += 1
                self.longest = max(self.longest, float(row.longest))
                self.earliest = min(self.earliest, float(row.earliest))
            if row.latest_due is not None:
                self.latest_due = max(self.latest_due, float(row.latest_due))


def _metrics(port: int) -> dict[str, float]:
    """Prometheus samples of a relay's /metrics, summed over their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def _mean_latency(metrics: dict[str, float]) -> float:
    """The relay's publish latency metric: created_at (database) to ack (host clock)."""
    count = metrics["oncely_relay_publish_latency_seconds_count"]
    return metrics["oncely_relay_publish_latency_seconds_sum"] / max(1.0, count)


def test_s13_two_relays_skewed_both_ways_share_the_outbox_under_load(chaos: Pipeline) -> None:
    lease = 3.0  # the harness's ONCELY_RELAY_LEASE_SECONDS
    consumer = chaos.consumer().start()
    ports = dict(zip(("ahead", "behind"), free_ports(2), strict=True))
    # Some linger keeps rows in flight, so a pause catches leases to take over.
    relays = {
        name: _skewed_relay(
            chaos,
            name,
            skew,
            ONCELY_RELAY_METRICS_PORT=str(ports[name]),
            ONCELY_RELAY_LINGER_MS="300",
        )
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
        chaos.wait_applied(chaos.count("SELECT count(*) FROM oncely_outbox"), timeout=300)
        recovery = time.monotonic() - resumed  # since the last pause ended
    assert all(relay.alive() for relay in relays.values()), chaos.logs()
    metrics = {name: _metrics(port) for name, port in ports.items()}
    rss = {name: relay.peak_rss_mb() for name, relay in relays.items()}
    consumer_rss = consumer.peak_rss_mb()
    report = check(chaos.engine, chaos.bootstrap, topics=[chaos.app.topic], effects=["ledger"])
    per_relay = " ".join(
        f"{name}_published={m['oncely_relay_published_total']:.0f}"
        f" {name}_lease_lost={m['oncely_relay_lease_lost_total']:.0f}"
        f" {name}_latency_metric_mean_s={_mean_latency(m):.0f}"
        f" {name}_peak_rss_mb={rss[name]:.0f}"
        for name, m in metrics.items()
    )
    print(
        f"S13 events={report.committed} recovery={recovery:.1f}s {per_relay} "
        f"consumer_peak_rss_mb={consumer_rss:.0f} lease_samples={watch.samples} "
        f"longest_lease_ahead_of_db_now={watch.longest:.2f}s "
        f"shortest_lease_after_creation={watch.earliest:.2f}s "
        f"latest_due_ahead_of_db_now={watch.latest_due:.2f}s {report.summary()}"
    )
    assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    assert all(m["oncely_relay_published_total"] > 0 for m in metrics.values()), per_relay
    assert watch.samples > 0
    assert watch.longest <= lease + 1.0, "a lease ran past lease_seconds from the DB's now()"
    assert watch.earliest > 0, "a lease ended before its row was created"
    assert watch.latest_due <= 2.0 + 1.0, "a row was due later than the longest backoff"
