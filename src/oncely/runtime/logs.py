"""Structured logs: one JSON object per line on stderr, with the ``extra`` fields of each call,
the ids of the active OpenTelemetry span, and librdkafka's own lines among them. Each line's
``time`` is ISO-8601 in UTC to the millisecond (``2026-11-29T09:00:00.123Z``)."""

from __future__ import annotations

import logging
import sys
import time
from enum import StrEnum

from pythonjsonlogger.json import JsonFormatter


class LogFormat(StrEnum):
    """How a long-running command writes its log lines."""

    JSON = "json"
    TEXT = "text"


class LogLevel(StrEnum):
    """The lowest level a long-running command logs."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class _SpanIds(logging.Filter):
    """Add ``trace_id`` and ``span_id`` (hex, as OpenTelemetry exporters show them) while a
    span is active; nothing when OpenTelemetry is not installed or no span is."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from opentelemetry import trace
        except ImportError:
            self._current_span = None
        else:
            self._current_span = trace.get_current_span

    def filter(self, record: logging.LogRecord) -> bool:
        if self._current_span is not None:
            context = self._current_span().get_span_context()
            if context.is_valid:
                record.trace_id = format(context.trace_id, "032x")
                record.span_id = format(context.span_id, "016x")
        return True


class _UtcJsonFormatter(JsonFormatter):
    """JSON lines whose ``time`` is ISO-8601 UTC with ``Z``, whatever the host's time zone."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{seconds}.{int(record.msecs):03d}Z"


def configure_logging(
    *, level: LogLevel | str = LogLevel.INFO, log_format: LogFormat = LogFormat.JSON
) -> None:
    """Send every record of the process (oncely's, librdkafka's, the application's) to stderr
    at ``level`` and above: one JSON object per line, or plain text with ``LogFormat.TEXT``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_SpanIds())
    if log_format is LogFormat.JSON:
        handler.setFormatter(
            _UtcJsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(str(level).upper())
