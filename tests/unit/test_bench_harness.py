"""The benchmark harness's pure logic: targets, ratios, CPU-bound marks, scale, the table."""

from __future__ import annotations

import time

import pytest
from bench.__main__ import _markdown
from bench.harness import Cell, Target, _take_idle, cpu_window, interleave, scale, scaled


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
    with cpu_window():
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:
            pass
    idle, cores = _take_idle()
    assert idle is not None and 0.0 <= idle <= 1.0
    assert cores is not None and cores["bench"] >= 0.5, cores
