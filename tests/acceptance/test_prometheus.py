"""The shipped Prometheus rules and Grafana dashboard, checked by Prometheus itself: promtool
validates and unit-tests the rules, and a real Prometheus server scraping a running relay,
consumer and task worker sees every metric the rules and the dashboard read, and each process's
standard ``process_*`` and ``python_*`` metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from oncely.devstack._process import free_port
from tests.apps.ledger import App
from tests.helpers import start_oncely, wait_until

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "oncely.json"
#: A metric name in PromQL: oncely's own, and ``up``; recording rules (``oncely:...``) are not.
_METRIC = re.compile(r"\b(oncely_[a-z_]+|up)\b")
#: Series a family's metadata names without (OpenMetrics names counters without ``_total``).
_SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is missing: `make test` installs it (Debian's prometheus package: "
            "apt-get install prometheus)",
            pytrace=False,
        )
    return found


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("promtool"), *args], cwd=RULES, capture_output=True, text=True, timeout=120
    )


def test_promtool_checks_the_rules() -> None:
    checked = _promtool("check", "rules", "rules.yml", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr


def test_promtool_unit_tests_pass() -> None:
    tested = _promtool("test", "rules", "tests.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test() -> None:
    alerts = {
        rule["alert"]
        for group in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
        for rule in group["rules"]
    }
    tested = {
        case["alertname"]
        for test in yaml.safe_load((RULES / "tests.yml").read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == tested


def _used_metrics() -> set[str]:
    expressions = [
        rule["expr"]
        for name in ("rules.yml", "alerts.yml")
        for group in yaml.safe_load((RULES / name).read_text())["groups"]
        for rule in group["rules"]
    ]
    dashboard = json.loads(DASHBOARD.read_text())
    expressions += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return {name for expr in expressions for name in _METRIC.findall(expr)}


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())["data"]


class _Processes:
    """Processes a test starts, each logging to a file; stopped (killed if need be) after."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[Any]] = []

    def start(self, name: str, argv: list[str]) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:
            self.started.append(
                subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            )

    def oncely(self, name: str, *argv: str, env: dict[str, str] | None = None) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:
            self.started.append(
                start_oncely(*argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )

    def stop(self) -> None:
        for process in self.started:
            process.terminate()
        for process in self.started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[_Processes]:
    running = _Processes(tmp_path)
    yield running
    running.stop()


@pytest.mark.usefixtures("ledger_tables")
def test_a_real_prometheus_scrapes_every_metric_the_rules_and_dashboard_use(
    database_url: str,
    kafka_bootstrap: str,
    new_ledger: Callable[..., App],
    processes: _Processes,
    tmp_path: Path,
) -> None:
    app = new_ledger()
    services = ["--database-url", database_url]
    kafka = ["--bootstrap-servers", kafka_bootstrap]
    ports = {job: free_port() for job in ("oncely-relay", "oncely-consumer", "oncely-tasks")}
    metrics = {job: ["--metrics-port", str(port)] for job, port in ports.items()}
    processes.oncely("relay", "relay", "run", *services, *kafka, *metrics["oncely-relay"])
    processes.oncely(
        "consumer",
        *("consume", "--app", "tests.apps.ledger:effects", "--effect", "ledger"),
        *services,
        *kafka,
        *metrics["oncely-consumer"],
        env=app.env,
    )
    processes.oncely(
        "tasks",
        *("tasks", "run", "--app", "examples.payments.app:app"),
        *services,
        *metrics["oncely-tasks"],
    )
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in ports.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_port()
    processes.start(
        "prometheus",
        [
            _tool("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
    )

    def all_up() -> bool:
        try:
            targets = _get(web, "/api/v1/targets")["activeTargets"]
        except OSError:
            return False
        return len(targets) == 3 and all(t["health"] == "up" for t in targets)

    wait_until(all_up, timeout=90)
    wait_until(
        lambda: "oncely_relay_shards" in _get(web, "/api/v1/label/__name__/values"), timeout=30
    )
    scraped = set(_get(web, "/api/v1/label/__name__/values")) | set(_get(web, "/api/v1/metadata"))
    used = _used_metrics()
    assert len(used) > 15  # the rules and the dashboard read many metrics
    missing = sorted(
        name
        for name in used
        if name not in scraped
        and not any(name.removesuffix(suffix) in scraped for suffix in _SERIES_SUFFIXES)
    )
    assert not missing, f"used by the rules or the dashboard, never scraped: {missing}"
    for standard in ("process_resident_memory_bytes", "python_info"):  # on every process
        series = _get(web, f"/api/v1/series?match[]={standard}")
        assert {s["job"] for s in series} == set(ports), standard
