"""`oncely demo` end to end (small): separate processes, faults, invariants from the run."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.helpers import oncely_process

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(450)
def test_the_demo_survives_its_faults_with_every_invariant_green(
    new_database: Callable[..., str], kafka_bootstrap: str
) -> None:
    env = {
        "ONCELY_DATABASE_URL": new_database(),
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "COLUMNS": "160",
    }
    result = oncely_process("demo", "--events", "400", env=env, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "✘" not in out
    assert re.search(r"transfers requested\s+│ 400 \(\+\d+ retried with the same key\)", out)
    assert re.search(r"events committed\s+│ 800 ", out), "two events per transfer, from this run"
    assert re.search(r"lost \(committed, not in Kafka\)\s+│ 0 ", out)
    assert re.search(r"duplicate effects\s+│ 0 ", out)
    assert "relay killed with SIGKILL mid-run" in out
    assert "ledger-projection replayed to earliest" in out
    # The writers offer 50 transfers/s open loop by default, and the run says what it got.
    _row(out, "offered load", r"50 transfers/s open loop; achieved \d+/s")
    _row(out, "machine CPU idle during the run", r"\d+%")
    _check_figures(out)


def _row(out: str, label: str, value: str) -> re.Match[str]:
    found = re.search(rf"│ {label}\s+│ {value}\s+│", out)
    assert found, f"no row {label!r} with a value like {value!r} in:\n{out[-4000:]}"
    return found


def _rate_agrees(shown: str, events: int, seconds: float) -> bool:
    """``shown`` events/s (rounded) is ``events`` over ``seconds`` (shown to 0.1 s)."""
    if shown == "-":
        return seconds < 0.05
    low = events / (seconds + 0.05) - 0.5
    high = events / (seconds - 0.05) + 0.5 if seconds > 0.05 else float("inf")
    return low <= int(shown) <= high


def _check_figures(out: str) -> None:
    """Throughput and commit-to-effect overall and outside the fault windows, and the windows.

    Only what holds in every run: the figures are there, numeric and consistent with each
    other (events outside + inside = overall, outside time <= run time, p50 <= p99); nothing
    compares the outside latency with the overall one.
    """
    applied = int(_row(out, "effects applied: ledger-projection", r"(\d+) of \d+")[1])
    rate = r"(\d+|-) events/s \((\d+) events in (\d+\.\d) s\)"
    overall = _row(out, r"throughput \(ledger\), overall", rate)
    outside = _row(out, r"throughput \(ledger\), outside fault windows", rate)
    windows = _row(out, "fault windows", r"(\d+), covering (\d+\.\d) s; (\d+) events inside")
    events, seconds = int(overall[2]), float(overall[3])
    assert events == applied, "every applied ledger effect counts in the overall figures"
    assert seconds > 0 and _rate_agrees(overall[1], events, seconds)
    assert int(outside[2]) + int(windows[3]) == events, "each event is inside or outside"
    assert float(outside[3]) <= seconds
    assert _rate_agrees(outside[1], int(outside[2]), float(outside[3]))
    latency = r"p50 (\d+) ms, p99 (\d+) ms \((\d+) events\)"
    total = _row(out, r"commit → effect \(ledger\), overall", latency)
    assert int(total[1]) <= int(total[2]) and int(total[3]) == events
    if int(outside[2]):
        calm = _row(out, r"commit → effect \(ledger\), outside fault windows", latency)
        assert int(calm[1]) <= int(calm[2]) and int(calm[3]) == int(outside[2])
    else:
        _row(out, r"commit → effect \(ledger\), outside fault windows", r"no events")
    assert "fault windows (seconds from the first commit)" in out
    assert int(windows[1]) >= 2, "the relay's kill and the replay at least"
    cells = r"\s+│\s+(-?\d+\.\d) │\s+(-?\d+\.\d) │\s+(\d+\.\d) s │\s+(\d+) │\s+(\d+ ms|-) │"
    relay = re.search(r"│ relay SIGKILL" + cells, out)
    replay = re.search(r"│ ledger replay \(\d+ re-read\)" + cells, out)
    assert relay and replay, out[-4000:]
    for row in (relay, replay):
        start, end, length = float(row[1]), float(row[2]), float(row[3])
        assert start <= end and abs(end - start - length) <= 0.16, "each shown to 0.1 s"
        assert int(row[4]) <= events
    assert int(replay[4]) == 0, "the replay starts after every effect was applied"
