"""The benchmark harness's pure logic: targets, ratios, absolute cells, CPU-bound marks, scale,
the table, the consumer cells' helpers (RSS points, commit-to-effect, reading /metrics), the
registry of cells, result files, the index and compare."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bench.__main__ import main
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
from bench.registry import DEFAULT, REGISTRY, UnknownCellError, owner, resolve
from bench.report import table
from bench.result_files import (
    CURRENT_BEGIN,
    CURRENT_END,
    RESULTS,
    _file_names,
    compare,
    current,
    index,
    provenance,
    refresh,
    stem,
    verdict_text,
    write,
)

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
    lines = table([missed, met.to_json()]).splitlines()
    assert lines[2].endswith("| >= 0.9 | **missed** |"), lines[2]
    assert lines[3].endswith("| <= 0.33 | met (CPU-bound: a) |"), lines[3]
    assert "| 1% / 50% |" in lines[3]


def test_a_cpu_bound_cell_that_needs_idle_is_not_a_result() -> None:
    cell = _cell([2.0, 2.0, 2.0], [10.0, 10.0, 10.0], "<= 0.33")
    cell.verdict_needs_idle = True
    cell.idle = {"a": [0.01, 0.01, 0.01], "b": [0.5, 0.5, 0.5]}
    result = cell.to_json()
    assert result["met"] is None
    line = table([result]).splitlines()[2]
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
    [line] = table([result]).splitlines()[2:]
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
    [line] = table([result]).splitlines()[2:]
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
    lines = table([result]).splitlines()
    assert lines[2].endswith("| <= 1.2 | no verdict |") and "undefined: b was <= 0" in lines[2]
    assert lines[3].startswith("| RX | context: a / c | 1.1 ") and lines[3].endswith("|  |  |")


# The registry, result files, the index and compare (issue 50).


def test_every_cell_has_an_id_a_slug_a_sentence_targets_and_a_time() -> None:
    ids = [spec.id for spec in REGISTRY]
    slugs = [spec.slug for spec in REGISTRY]
    assert len(set(ids)) == len(ids) and len(set(slugs)) == len(slugs)
    for spec in REGISTRY:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", spec.slug), spec.slug
        assert spec.measures.endswith(".") and spec.figures and spec.minutes > 0, spec.id
        assert all(spec.figures.values()), spec.id
    # The ids docs/performance.md and earlier results use stay.
    assert {"R1", "R-QUIET", "S-MANY", "R-DBZ-p99", "R5", "R-RETAIN"} <= set(ids)
    assert {"R-CLUSTER", "R-MISSING-TOPIC", "R-COMPLETENESS"}.isdisjoint(s.id for s in DEFAULT)


def test_cells_are_named_by_id_or_slug_in_any_case_and_run_in_registry_order() -> None:
    specs = resolve(["relay-one-key", "r1", "R-DBZ p99", "R1"])
    assert [spec.id for spec in specs] == ["R-DBZ-p99", "R1", "R-HOT"]
    with pytest.raises(UnknownCellError, match="unknown cells: R99, nope"):
        resolve(["R1", "R99", "nope"])


def test_a_figure_belongs_to_the_cell_that_names_it_exactly_before_a_prefix() -> None:
    assert owner("R-DBZ p99") is resolve(["R-DBZ-p99"])[0]  # not R-DBZ's "R-DBZ" + suffix
    assert owner("R4 raw Kafka") is resolve(["R4"])[0]
    assert owner("R-MISSING-TOPIC p99 (before)") is resolve(["missing-topic"])[0]
    assert owner("R2b") is None


def test_list_prints_every_cell_with_its_slug_time_and_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["--list"])
    out = capsys.readouterr().out
    for spec in REGISTRY:
        assert re.search(rf"^{re.escape(spec.id)} +{spec.slug} +~", out, re.MULTILINE), spec.id
        assert f"target: {spec.target}" in out
    assert "target: p50 <= 1.2; p99 <= 1.5" in out  # R-QUIET's two figures


def test_a_result_name_says_when_and_which_cells_and_never_overwrites(tmp_path: Path) -> None:
    started = datetime(2026, 12, 8, 1, 30, 5, tzinfo=UTC)
    assert stem(started, ["R1", "R-QUIET"], default=False) == "2026-12-08-013005-r1-r-quiet"
    assert stem(started, ["R1"], default=True) == "2026-12-08-013005-all"
    many = stem(started, ["R1", "R2", "R5", "R7", "R3", "R4"], default=False)
    assert many == "2026-12-08-013005-r1-r2-r5-r7-and-2"
    first = write(tmp_path, "run", {".json": "{1}", ".md": "one"})
    second = write(tmp_path, "run", {".json": "{2}", ".md": "two"})
    assert (first, second) == ("run", "run-2")
    assert (tmp_path / "run.md").read_text() == "one"
    assert (tmp_path / "run-2.md").read_text() == "two"


def test_a_result_records_the_commit_and_whether_the_tree_was_dirty(tmp_path: Path) -> None:
    assert provenance(tmp_path) == {"commit": None, "dirty": None}  # not a git work tree

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=b", "-c", "user.email=b@b", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-qm", "one")
    assert provenance(tmp_path) == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "INDEX.md").write_text("one\n")
    git("add", "bench")
    git("commit", "-qm", "two")
    (tmp_path / "bench" / "results" / "INDEX.md").write_text("a run's own output\n")
    assert provenance(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance(tmp_path)["dirty"] is True


def _ratio(name: str, numerator: list[float], denominator: list[float], target: str) -> Any:
    cell = Cell(name, "a", ["b"], "rows/s", target=target, measures="a / b")
    cell.rates = {"a": numerator, "b": denominator}
    return cell.to_json()


def _result_file(directory: Path, name: str, cells: list[Any], **environment: Any) -> Path:
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"environment": environment, "cells": cells}))
    return path


def test_the_index_shows_each_figure_from_its_latest_run_with_its_commit(tmp_path: Path) -> None:
    _result_file(
        tmp_path,
        "2026-12-01-run-a",  # written before results recorded the commit
        [_ratio("R1", [1.0] * 3, [4.0] * 3, ">= 0.5"), _ratio("R2b", [1.0] * 3, [1.0] * 3, "")],
        bench_scale=1.0,
    )
    _result_file(
        tmp_path,
        "2026-12-08-013005-r1",
        [_ratio("R1", [3.0] * 3, [4.0] * 3, ">= 0.5")],
        bench_scale=0.1,
        commit="0123456789abcdef",
        dirty=True,
        started="2026-12-08T01:30:05+00:00",
    )
    _result_file(
        tmp_path, "2026-12-02-run-b", [_ratio("R2", [1.0] * 3, [2.0] * 3, ">= 0.9")], bench_scale=1
    )
    text = index(tmp_path)
    lines = text.splitlines()
    [r1] = [line for line in lines if line.startswith("| R1 |")]
    assert "| 0.75 (0.75 to 0.75) | >= 0.5 | met | 2026-12-08 | 012345678+dirty | 0.1 |" in r1
    [r2] = [line for line in lines if line.startswith("| R2 |")]
    assert "| **missed** | 2026-12-02 | unknown | 1 |" in r2
    assert "| R-QUIET | quiet-commit-to-kafka | not run yet | p50 <= 1.2; p99 <= 1.5 |" in text
    retired = text.split("## Figures no cell writes any more")[1].split("## Every run")[0]
    assert "| R2b |" in retired
    runs_part = text.split("## Every run, newest first")[1]
    assert runs_part.index("2026-12-08-013005-r1") < runs_part.index("2026-12-02-run-b")
    assert runs_part.index("2026-12-02-run-b") < runs_part.index("2026-12-01-run-a")


def test_refresh_writes_the_index_and_the_docs_block_only(tmp_path: Path) -> None:
    _result_file(tmp_path, "2026-12-02-run-b", [_ratio("R2", [1.0] * 3, [2.0] * 3, ">= 0.9")])
    docs = tmp_path / "performance.md"
    docs.write_text(f"# P\n\nbefore\n{CURRENT_BEGIN}\nold\n{CURRENT_END}\nafter\n")
    refresh(tmp_path, docs)
    assert (tmp_path / "INDEX.md").read_text() == index(tmp_path)
    text = docs.read_text()
    assert text.startswith("# P\n\nbefore\n") and text.endswith(f"{CURRENT_END}\nafter\n")
    assert "old" not in text and "| `bench/results/2026-12-02-run-b.json` |" in text


def test_the_docs_hold_the_current_figures_of_the_index() -> None:
    """docs/performance.md's "In short" table is the index's: `python -m bench index` after
    adding result files."""
    docs = (Path(__file__).parents[2] / "docs" / "performance.md").read_text()
    block = docs.split(CURRENT_BEGIN)[1].split(CURRENT_END)[0].strip()
    assert block == _file_names(current(RESULTS)).strip()


def test_compare_puts_two_runs_figures_side_by_side(tmp_path: Path) -> None:
    a = _result_file(
        tmp_path,
        "a",
        [
            _ratio("R1", [1.0] * 3, [4.0] * 3, ">= 0.5"),
            _ratio("R2", [1.0] * 3, [2.0] * 3, ">= 0.9"),
        ],
        commit="aaaaaaaaaaaa",
        dirty=False,
        bench_scale=0.1,
    )
    b = _result_file(tmp_path, "b", [_ratio("R1", [3.0] * 3, [4.0] * 3, ">= 0.5")], bench_scale=0.1)
    text = compare(a, b)
    assert f"A: {a} (aaaaaaaaa, BENCH_SCALE=0.1)" in text
    assert f"B: {b} (unknown, BENCH_SCALE=0.1)" in text
    assert "| R1 | >= 0.5 | 0.25 (0.25 to 0.25), **missed** | 0.75 (0.75 to 0.75), met |" in text
    assert "| R2 | >= 0.9 | 0.5 (0.5 to 0.5), **missed** | not measured |" in text


@pytest.mark.parametrize("denominator", [[0.0, 2.0, 2.0], [2.0, -0.1, 2.0]])
def test_no_ratio_over_a_denominator_at_or_below_zero_is_called_met(
    denominator: list[float],
) -> None:
    """A <= target would call a negative ratio met (R-QUIET p50's -6.8), and a zero denominator
    has no ratio at all: no verdict, and the result says why."""
    result = _ratio("R-QUIET p50", [1.0, 1.0, 1.0], denominator, "<= 1.2")
    assert result["met"] is None
    assert result["no_verdict"] == "b was <= 0 in a repetition: the ratio is undefined"
    assert verdict_text(result) == f"no verdict: {result['no_verdict']}"
    # A result of an older harness (no undefined_ratios, its own "met") is judged again.
    old = {k: v for k, v in result.items() if k not in ("undefined_ratios", "no_verdict")}
    old["met"] = True
    assert verdict(old) == (None, "b was <= 0 in a repetition: the ratio is undefined")
    assert _ratio("R-QUIET p50", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], "<= 1.2")["met"] is True
