"""The command line's one error boundary: every error a user can cause becomes one line.

Commands raise; this module prints ``error: <what is wrong>; <what to do>`` on stderr and gives
the :class:`ExitCode`. With ``ONCELY_DEBUG=1`` the traceback is shown instead.
"""

from __future__ import annotations

import enum
import os
import re
import sys
from collections.abc import Iterator, Sequence

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from oncely import settings
from oncely.cli._environment import known_variables, unknown_variables
from oncely.errors import ConfigurationError, OncelyError


class ExitCode(enum.IntEnum):
    """Every exit status of ``oncely`` (their meanings: :data:`MEANINGS`)."""

    OK = 0
    FAILED = 1
    BAD_INPUT = 2
    KAFKA_UNAVAILABLE = 3
    INTERRUPTED = 130


#: What each exit status means, as docs/reference/cli.md lists them.
MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "The command did what it was asked and found nothing wrong.",
    ExitCode.FAILED: (
        "The operation failed (the database or the broker unreachable, a change refused), or a "
        "check found what it looks for (a verify problem, a schema break, a topic weaker than "
        "declared, a stale file, no stack running)."
    ),
    ExitCode.BAD_INPUT: (
        "Bad input or configuration (an option, an `ONCELY_*` value, an application that does "
        "not load, a replay, verification or upgrade that cannot be carried out as asked): the "
        "command did not start its work."
    ),
    ExitCode.KAFKA_UNAVAILABLE: (
        "`oncely status` could not reach Kafka (the database part of its report is still shown)."
    ),
    ExitCode.INTERRUPTED: "Interrupted (Ctrl-C): every process the command started was stopped.",
}


def run(app: typer.Typer, argv: Sequence[str]) -> int:
    """Run ``app`` on ``argv`` and return its exit status, reporting any error a user can cause
    as one line on stderr (the traceback instead when ``ONCELY_DEBUG=1``). Warns first about
    each ``ONCELY_*`` variable oncely does not read."""
    for warning in unknown_variables(os.environ, known_variables()):
        sys.stderr.write(warning + "\n")
    try:
        result = app(args=list(argv), prog_name="oncely", standalone_mode=False)
    except typer.Abort:
        sys.stderr.write("error: interrupted\n")
        return ExitCode.INTERRUPTED
    except typer.TyperException as exc:  # click's ClickException family, as typer vendors it
        message = _one_line(exc.format_message())
        if not message:  # no arguments: the help was shown
            return int(exc.exit_code)
        context = getattr(exc, "ctx", None)
        if context is not None:  # a usage error: the command line itself is wrong
            message += f"; see {context.command_path} --help"
        sys.stderr.write(f"error: {message}\n")
        return int(exc.exit_code)
    except Exception as exc:
        described = describe(exc)
        if described is None or os.environ.get("ONCELY_DEBUG") == "1":
            raise  # not a user's error but a bug: its traceback is what to report
        sys.stderr.write(f"error: {described[0]}\n")
        return described[1]
    return result if isinstance(result, int) else 0


def describe(exc: BaseException) -> tuple[str, int] | None:
    """The one line (without ``error:``) and the exit status for ``exc``; ``None`` for an error
    no input or environment explains (a bug)."""
    import sqlalchemy as sa  # imported here: a command that never reached them starts faster
    from confluent_kafka import KafkaError, KafkaException

    if isinstance(exc, ValidationError):
        return _settings_error(exc), ExitCode.BAD_INPUT
    if isinstance(exc, SettingsError):
        return _unparsable_setting(exc), ExitCode.BAD_INPUT
    if isinstance(exc, _cannot_run_as_asked()):
        return _one_line(str(exc)), ExitCode.BAD_INPUT
    if isinstance(exc, OncelyError):
        return _one_line(str(exc)), ExitCode.FAILED
    if isinstance(exc, sa.exc.DBAPIError):
        cause = _one_line(str(exc.orig)) if exc.orig is not None else type(exc).__name__
        return (
            f"database failure: {cause}; check --database-url (ONCELY_DATABASE_URL) and that "
            "PostgreSQL runs and accepts the connection"
        ), ExitCode.FAILED
    if isinstance(exc, KafkaException):
        error = exc.args[0] if exc.args else None
        cause = _one_line(error.str() if isinstance(error, KafkaError) else str(exc))
        if isinstance(error, KafkaError) and error.code() == KafkaError._INVALID_ARG:
            return (
                f"the Kafka client refused its configuration: {cause}; fix or remove the key "
                "in ONCELY_KAFKA_EXTRA (raw librdkafka settings), or the ONCELY_KAFKA_* "
                "setting that sets it"
            ), ExitCode.BAD_INPUT
        return (
            f"Kafka failure: {cause}; check --bootstrap-servers "
            "(ONCELY_KAFKA_BOOTSTRAP_SERVERS) and that the broker runs"
        ), ExitCode.FAILED
    return None


def _cannot_run_as_asked() -> tuple[type[OncelyError], ...]:
    """The errors that mean the request itself cannot be carried out (exit 2), besides bad
    configuration: a replay or verification that cannot be planned, an upgrade the database's
    state refuses, a dead-letter topic the consumer cannot create."""
    from oncely.consumers.dlq import DeadLetterError
    from oncely.consumers.replay import ReplayError
    from oncely.ops.verify import VerifyError
    from oncely.storage.migrations import UpgradeRefusedError

    return ConfigurationError, ReplayError, VerifyError, UpgradeRefusedError, DeadLetterError


def _settings_error(exc: ValidationError) -> str:
    prefix = _env_prefix(exc.title)
    problems = []
    seen = set()
    for error in exc.errors():
        loc = error["loc"]
        if not loc:  # a check across fields: its message names the variables
            problems.append(str(error["msg"]).removeprefix("Value error, "))
            continue
        name = f"{prefix}{loc[0]}".upper()
        if len(loc) > 1:  # inside a JSON value: the key it is wrong at (once per key)
            if loc[:2] in seen:
                continue
            seen.add(loc[:2])
            problems.append(f"{name} at {loc[1]!r}: {error['msg']}")
            continue
        given = error.get("input")
        value = f"={given!r}" if isinstance(given, str | int | float) else ""
        problems.append(f"{name}{value}: {error['msg']}")
    return "; ".join(problems) + "; fix or unset the variable (the command's --help lists them)"


def _unparsable_setting(exc: SettingsError) -> str:
    """A JSON-valued ``ONCELY_*`` variable (``ONCELY_KAFKA_EXTRA``, ...) that does not parse."""
    field = re.search(r'field "([^"]+)"', str(exc))
    names = sorted(_variables_of(field.group(1))) if field else []
    variable = " or ".join(names) or "an ONCELY_* variable"
    cause = f" ({_one_line(str(exc.__cause__))})" if exc.__cause__ is not None else ""
    return f"{variable} is not valid JSON{cause}; set it to a JSON object, or unset it"


def _variables_of(field: str) -> Iterator[str]:
    """The ``ONCELY_*`` names of the settings fields called ``field``."""
    for model in vars(settings).values():
        is_settings = isinstance(model, type) and issubclass(model, BaseSettings)
        if is_settings and field in model.model_fields:
            yield f"{model.model_config.get('env_prefix', '')}{field}".upper()


def _env_prefix(title: str) -> str:
    model = getattr(settings, title, None)
    if isinstance(model, type) and issubclass(model, BaseSettings):
        return str(model.model_config.get("env_prefix", ""))
    return ""


def _one_line(text: str) -> str:
    """The first non-empty line of ``text`` (drivers add hints and URLs on later lines)."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip().rstrip(".;")
    return text.strip()
