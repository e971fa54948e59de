"""Every oncely process's /metrics carries prometheus-client's standard process_* and python_*
collectors next to its own metrics."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oncely.runtime.http import HealthServer
from oncely.runtime.metrics import ConsumerMetrics, RelayMetrics, TaskMetrics

STANDARD = {
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
    "python_info",
    "python_gc_objects_collected",
    "python_gc_collections",
}


@pytest.mark.parametrize("metrics", [RelayMetrics, ConsumerMetrics, TaskMetrics])
def test_each_process_serves_the_standard_process_and_python_metrics(
    metrics: type[RelayMetrics | ConsumerMetrics | TaskMetrics],
) -> None:
    server = HealthServer(
        registry=metrics().registry,
        healthy=lambda: True,
        ready=lambda: True,
        port=0,
        host="127.0.0.1",
    )
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.stop()
    families = {family.name for family in text_string_to_metric_families(text)}
    assert not STANDARD - families, f"missing: {sorted(STANDARD - families)}"
    assert any(name.startswith("oncely_") for name in families)
