"""Log lines: librdkafka's own lines through oncely's logger as JSON with their level and client,
span ids while a span is active, and nothing on stderr from a process that configured no
logging."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka.admin import AdminClient
from opentelemetry.sdk.trace import TracerProvider

from oncely.devstack._process import free_port
from oncely.runtime.logs import LogFormat, configure_logging
from oncely.settings import KafkaSettings


def _stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_librdkafka_lines_are_json_with_their_level_and_client(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging()
    lines: list[str] = []
    nobody = f"127.0.0.1:{free_port()}"
    admin = AdminClient(KafkaSettings(bootstrap_servers=nobody).client_config())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not lines:
        admin.poll(0.2)
        lines.extend(_stderr_lines(capsys))
    records = [json.loads(line) for line in lines]
    assert records, "a refused connection is logged by librdkafka"
    first = records[0]
    assert first["logger"] == "oncely.kafka"
    assert first["level"] == "ERROR"
    assert first["client"].startswith("rdkafka#")
    assert first["facility"] == "FAIL"
    assert nobody in first["message"] and "Connection refused" in first["message"]


def test_a_line_logged_inside_a_span_carries_its_ids(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        logging.getLogger("oncely.test").info("inside")
    logging.getLogger("oncely.test").info("outside")
    inside, outside = (json.loads(line) for line in _stderr_lines(capsys))
    context = span.get_span_context()
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
    assert "trace_id" not in outside


def test_json_time_is_iso_8601_utc_with_z_whatever_the_time_zone(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "Pacific/Kiritimati")  # UTC+14: a local time would not pass
    time.tzset()
    try:
        configure_logging()
        before = datetime.now(UTC)
        logging.getLogger("oncely.test").info("now")
        after = datetime.now(UTC)
    finally:
        monkeypatch.undo()
        time.tzset()
    (line,) = _stderr_lines(capsys)
    stamp = json.loads(line)["time"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", stamp), stamp
    logged = datetime.fromisoformat(stamp)  # "Z": UTC
    assert before - timedelta(milliseconds=1) <= logged <= after


def test_text_format_is_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(log_format=LogFormat.TEXT, level="warning")
    logging.getLogger("oncely.test").info("dropped")
    logging.getLogger("oncely.test").warning("kept")
    (line,) = _stderr_lines(capsys)
    assert line.endswith(" WARNING oncely.test kept")


def test_without_logging_configured_librdkafka_prints_nothing() -> None:
    script = (
        "import time\n"
        "from confluent_kafka.admin import AdminClient\n"
        "from oncely.settings import KafkaSettings\n"
        f"admin = AdminClient(KafkaSettings(bootstrap_servers='127.0.0.1:{free_port()}')"
        ".client_config())\n"
        "deadline = time.monotonic() + 2\n"
        "while time.monotonic() < deadline: admin.poll(0.2)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stderr == ""
