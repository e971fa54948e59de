"""Structured logs: one JSON object per line on stderr, with the ``extra`` fields of each call."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter


def configure_logging(*, level: str = "INFO", json: bool = True) -> None:
    """Send oncely's (and the root logger's) records to stderr, as JSON unless ``json=False``."""
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
