"""Consoles shared by the commands: results on stdout, progress and diagnostics on stderr."""

from __future__ import annotations

from rich.console import Console

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

#: The last line of every destructive command's dry run (stdout).
DRY_RUN = "dry run: nothing changed; run again with {flag} to do it"


def print_dry_run(flag: str = "--execute") -> None:
    """Say that nothing was changed, and which flag makes the change."""
    out.print(DRY_RUN.format(flag=flag))
