"""The benchmark harness's pure logic: targets, ratios, absolute cells, CPU-bound marks, scale,
the table, and the consumer cells' helpers (RSS points, commit-to-effect, reading /metrics)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from bench.__main__ import _markdown
from bench.consumer_cells import at_shares
from bench.fixtures import Running, memory_mb, metric
from bench.harness import (
    Cell,
    Target,
    _take_idle,
    cpu_window,
    interleave,
    scale,
    scaled,
    verdict,
)
from bench.latency_cells import latencies

from oncely.devstack._process import free_port
from oncely.runtime.http import HealthServer
from oncely.runtime.metrics import ConsumerMetrics


def test_target_met_in_its_direction() -> None:
    assert Target(">= 1.5").met(1.5) is True
    assert Target(">= 1.5").met(1.49) is False
    assert Target("<= 0.33").met(0.3) is True
    assert Target("<= 0.33").met(0.34) is False
    assert Target("(context: bounded by cores)").met(5.0) is None


def _cell(numerator: list[float], denominator: list[float], target: str = ">= 1.0") -> Cell:
    cell = Cell("RX", "a", ["b"], "rows/s", target=target, measures="a / b")
    cell.rates = {"a": numerator, "b": denominator}
    return cell


def test_ratio_is_the_median_of_the_per_repetition_ratios() -> None:
    # Medians of the sides would give 20/10 = 2.0; the pairs give 1.0, 4.0, 0.5 -> 1.0.
    ratio = _cell([10.0, 20.0, 30.0], [10.0, 5.0, 60.0]).ratios()["b"]
    assert ratio == {"median": 1.0, "min": 0.5, "max": 4.0}


def test_cpu_bound_sides_are_named() -> None:
    cell = _cell([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    cell.idle = {"a": [0.02, 0.05, 0.5], "b": [0.4, 0.5, 0.6]}
    assert cell.cpu_bound() == ["a"]
    assert cell.to_json()["cpu_bound"] == ["a"]


def test_table_says_met_missed_and_cpu_bound() -> None:
    missed = _cell([5.0, 5.0, 5.0], [10.0, 10.0, 10.0], ">= 0.9").to_json()
    met = _cell([2.0, 2.0, 2.0], [10.0, 10.0, 10.0], "<= 0.33")
    met.idle = {"a": [0.01, 0.01, 0.01], "b": [0.5, 0.5, 0.5]}
    lines = _markdown([missed, met.to_json()]).splitlines()
    assert lines[2].endswith("| >= 0.9 | **missed** |"), lines[2]
    assert lines[3].endswith("| <= 0.33 | met (CPU-bound: a) |"), lines[3]
    assert "| 1% / 50% |" in lines[3]


def test_a_cpu_bound_cell_that_needs_idle_is_not_a_result() -> None:
    cell = _cell([2.0, 2.0, 2.0], [10.0, 10.0, 10.0], "<= 0.33")
    cell.verdict_needs_idle = True
    cell.idle = {"a": [0.01, 0.01, 0.01], "b": [0.5, 0.5, 0.5]}
    result = cell.to_json()
    assert result["met"] is None
    line = _markdown([result]).splitlines()[2]
    assert line.endswith("| <= 0.33 | not a result (CPU-bound: a) |"), line
    cell.idle = {"a": [0.5, 0.5, 0.5], "b": [0.5, 0.5, 0.5]}
    assert cell.to_json()["met"] is True


def test_a_cell_needing_more_idle_than_a_turn_had_is_not_a_result() -> None:
    """R4-quiet's target names 30% CPU idle: 20% idle is no result, though not CPU-bound."""
    cell = _cell([2.0, 2.0, 2.0], [10.0, 10.0, 10.0], "<= 0.33")
    cell.verdict_needs_idle, cell.idle_needed = True, 0.30
    cell.idle = {"a": [0.2, 0.2, 0.2], "b": [0.5, 0.5, 0.5]}
    assert cell.to_json()["met"] is None
    cell.idle = {"a": [0.3, 0.35, 0.4], "b": [0.5, 0.5, 0.5]}
    assert cell.to_json()["met"] is True


def test_interleave_alternates_after_a_warm_up() -> None:
    calls: list[str] = []

    def side(name: str) -> float:
        calls.append(name)
        return 1.0

    run = interleave({"a": lambda: side("a"), "b": lambda: side("b")}, repetitions=2, warmup=True)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert run.rates == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert all(0.0 <= x <= 1.0 for values in run.idle.values() for x in values)


def test_scale_multiplies_sizes_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SCALE", "0.1")
    assert scaled(50_000, minimum=500) == 5000
    assert scaled(1000, minimum=500) == 500
    monkeypatch.setenv("BENCH_SCALE", "fast")
    with pytest.raises(SystemExit, match="BENCH_SCALE='fast': give a positive number"):
        scale()


def test_cpu_window_counts_this_process_cores() -> None:
    started = time.monotonic()
    with cpu_window() as window:
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:
            pass
    wall = time.monotonic() - started
    idle, cores = _take_idle()
    assert idle is not None and 0.0 <= idle <= 1.0
    assert window.idle == idle and window.seconds <= wall
    assert window.by_pid[os.getpid()][0] == "bench"
    # 0.3 s of this process's CPU over the window's wall time, however loaded the machine is.
    assert cores is not None and 0.7 * 0.3 / wall <= cores["bench"] <= 1.3 * 0.3 / wall, cores
    assert abs(window.cores["bench"] - window.by_pid[os.getpid()][1]) < 1e-9


def test_strict_targets_compare_strictly() -> None:
    assert Target("< 25").met(24.9) is True
    assert Target("< 25").met(25.0) is False
    assert Target("> 3").met(3.0) is False
    assert Target(">= 3").met(3.0) is True


def test_an_absolute_cell_meets_its_target_with_its_own_values() -> None:
    cell = Cell("R4", "p99 at 50%", [], "ms", target="< 25", summary="p50/p95/p99 4/9/30 ms")
    cell.rates = {"p99 at 50%": [30.0, 20.0, 24.0]}
    cell.idle = {"p99 at 50%": [0.4, 0.5, 0.6]}
    result = cell.to_json()
    assert result["absolute"] is True and result["ratios"] == {}
    assert result["value"] == {"median": 24.0, "min": 20.0, "max": 30.0}
    assert result["met"] is True
    [line] = _markdown([result]).splitlines()[2:]
    assert "| 24.0 ms (20.0 to 30.0), absolute | p50/p95/p99 4/9/30 ms | 50% | < 25 | met |" in (
        line
    ), line
    cell.rates = {"p99 at 50%": [30.0, 26.0, 24.0]}
    assert cell.to_json()["met"] is False


def test_the_memory_line_shows_the_backlog_points_and_the_peak() -> None:
    result = {
        "cell": "R-RSS",
        "kind": "memory",
        "measures": "peak RSS",
        "rate_per_second": 12000.0,
        "rss_mib": {"ready": 70.0, "10%": 80.0, "50%": 81.0, "90%": 82.0, "end": 82, "peak": 84},
        "growth_10_to_90": 0.025,
    }
    [line] = _markdown([result]).splitlines()[2:]
    assert "| peak 84 MiB (one run) | RSS at 10%/50%/90% 80.0/81.0/82.0 MiB; 10%→90% +2.5%" in line


def test_rss_points_are_the_first_samples_past_each_share() -> None:
    samples = [(0.0, 50.0), (5.0, 60.0), (10.0, 61.0), (49.0, 62.0), (50.0, 63.0), (95.0, 64.0)]
    assert at_shares(samples, 100, (0.1, 0.5, 0.9)) == {"10%": 61.0, "50%": 63.0, "90%": 64.0}
    assert at_shares(samples, 1000, (0.5,)) == {"50%": None}


def test_commit_to_effect_leaves_out_the_warm_up_and_counts_the_missing() -> None:
    due = [100.0, 100.5, 101.0, 101.5, 102.0]
    committed = [100.001, 100.502, 101.003, 101.504, 102.010]
    # Event 0 is in the warm-up second, event 4 was never applied.
    applied = {0: 100.5, 1: 100.512, 2: 101.013, 3: 101.524}
    written = {1: 100.532, 2: 101.033, 3: 101.544}
    result = latencies(due, committed, applied, warmup_seconds=0.5, written=written)
    assert result["events_measured"] == 3 and result["missing"] == 1
    assert result["commit_to_row_written_ms"]["p50"] == pytest.approx(30.0, abs=0.1)
    assert result["commit_to_effect_ms"]["p50"] == pytest.approx(10.0, abs=0.1)
    assert result["commit_to_effect_ms"]["max"] == pytest.approx(20.0, abs=0.1)
    assert result["schedule_to_effect_ms"]["max"] == pytest.approx(24.0, abs=0.1)
    assert result["writer_lag_ms"]["max"] == pytest.approx(10.0, abs=0.1)


def test_memory_of_a_process_is_its_rss_and_peak() -> None:
    rss, peak = memory_mb(os.getpid())
    assert 1.0 < rss <= peak


def test_a_metric_is_read_from_a_process_metrics_page() -> None:
    metrics = ConsumerMetrics()
    metrics.applied.labels("apply").inc(3)
    metrics.applied.labels("other").inc(5)
    port = free_port()
    server = HealthServer(
        registry=metrics.registry, healthy=lambda: True, ready=lambda: True, port=port
    )
    server.start()
    try:
        running = Running(port, None, Path("unused"))  # type: ignore[arg-type]
        assert metric(running, "oncely_consumer_applied_total", effect="apply") == 3.0
        assert metric(running, "oncely_consumer_applied_total", effect="none") == 0.0
    finally:
        server.stop()


def test_a_ratio_over_a_denominator_at_or_below_zero_is_undefined() -> None:
    """R-QUIET's raw side can be under LogAppendTime's 1 ms resolution (-0.1 ms): no ratio, no
    verdict, and the other denominators keep theirs."""
    cell = Cell("RX", "a", ["b", "c"], "ms", target="<= 1.2", measures="a / b")
    cell.rates = {"a": [1.0, 1.2, 1.1], "b": [-0.1, 0.2, 0.3], "c": [1.0, 1.0, 1.0]}
    result = cell.to_json()
    assert result["undefined_ratios"] == ["b"]
    assert "b" not in result["ratios"] and result["ratios"]["c"]["median"] == 1.1
    assert result["met"] is None
    lines = _markdown([result]).splitlines()
    assert lines[2].endswith("| <= 1.2 | no verdict |") and "undefined: b was <= 0" in lines[2]
    assert lines[3].startswith("| RX | context: a / c | 1.1 ") and lines[3].endswith("|  |  |")


@pytest.mark.parametrize("denominator", [[0.0, 2.0, 2.0], [2.0, -0.1, 2.0]])
def test_no_ratio_over_a_denominator_at_or_below_zero_is_called_met(
    denominator: list[float],
) -> None:
    """A <= target would call a negative ratio met (R-QUIET p50's -6.8), and a zero denominator
    has no ratio at all: no verdict, and the result says why."""
    cell = Cell("R-QUIET p50", "a", ["b"], "ms", target="<= 1.2", measures="a / b")
    cell.rates = {"a": [1.0, 1.0, 1.0], "b": denominator}
    result = cell.to_json()
    assert result["met"] is None
    assert result["no_verdict"] == "b was <= 0 in a repetition: the ratio is undefined"
    # A result of an older harness (no undefined_ratios, its own "met") is judged again.
    old = {k: v for k, v in result.items() if k not in ("undefined_ratios", "no_verdict")}
    old["met"] = True
    assert verdict(old) == (None, "b was <= 0 in a repetition: the ratio is undefined")
    cell.rates["b"] = [1.0, 1.0, 1.0]
    assert cell.to_json()["met"] is True
