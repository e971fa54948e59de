"""Consoles shared by the commands: results on stdout, progress and diagnostics on stderr."""

from __future__ import annotations

from rich.console import Console

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
