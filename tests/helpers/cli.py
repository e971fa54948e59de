"""The ``oncely`` command line run in this process (:func:`oncely_cli`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class CliResult:
    """What ``oncely ...`` printed and its exit status."""

    exit_code: int
    stdout: str
    stderr: str
    output: str
    """stdout and stderr interleaved, as a terminal shows them."""


def oncely_cli(*argv: str, env: dict[str, str] | None = None) -> CliResult:
    """Run ``oncely ARGV`` in this process, through the command line's error boundary (as
    ``main()`` does), with ``env`` added to the environment."""
    from typer.testing import CliRunner

    from oncely.cli import app
    from oncely.cli._errors import run

    with CliRunner().isolation(env=env) as (stdout, stderr, output):
        code = run(app, list(argv))
        sys.stdout.flush()
        sys.stderr.flush()
        return CliResult(
            code, stdout.getvalue().decode(), stderr.getvalue().decode(), output.getvalue().decode()
        )
