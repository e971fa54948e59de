"""Options shared by the commands that reach PostgreSQL and Kafka, and small value parsers."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from oncely import durations
from oncely.runtime.logs import LogFormat, LogLevel


def check_database_url(url: str | None) -> str | None:
    """Refuse a URL that does not parse, or whose database is not PostgreSQL."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    if url is None:
        return None
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError:
        raise typer.BadParameter(
            f"not a database URL; use {_URL_FORM}", param_hint="--database-url"
        ) from None
    if parsed.get_backend_name() != "postgresql":
        raise typer.BadParameter(
            f"a {parsed.get_backend_name()} URL: oncely supports PostgreSQL; use {_URL_FORM}",
            param_hint="--database-url",
        )
    return url


_URL_FORM = "postgresql+psycopg://user:password@host:5432/database"

APP_HELP = (
    "The application, as module:attribute: an oncely.App, or its Registry, Effects or Tasks object."
)
AppOption = Annotated[
    str | None, typer.Option("--app", envvar="ONCELY_APP", help=APP_HELP, show_default=False)
]
AppArgument = Annotated[
    str | None,
    typer.Argument(
        metavar="APP", help="The application (or --app / ONCELY_APP).", show_default=False
    ),
]
RequiredApp = Annotated[
    str, typer.Option("--app", envvar="ONCELY_APP", help=APP_HELP, show_default=False)
]


def app_target(argument: str | None, option: str | None) -> str:
    """The application named by a command's positional argument or by ``--app``/``ONCELY_APP``
    (the argument wins: it was typed for this command); ``typer.BadParameter`` if neither."""
    target = argument or option
    if target is None:
        raise typer.BadParameter(
            "name the application as module:attribute (or set ONCELY_APP)", param_hint="--app"
        )
    return target


DatabaseUrl = Annotated[
    str,
    typer.Option(
        envvar="ONCELY_DATABASE_URL",
        help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db.",
        show_default=False,
        callback=check_database_url,
    ),
]
BootstrapServers = Annotated[
    str,
    typer.Option(
        "--bootstrap-servers",
        envvar="ONCELY_KAFKA_BOOTSTRAP_SERVERS",
        help="Kafka bootstrap servers (host:port,...). Raw client settings: ONCELY_KAFKA_EXTRA.",
        show_default=False,
    ),
]

LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        "--log-format",
        envvar="ONCELY_LOG_FORMAT",
        help="Log lines as JSON objects (librdkafka's among them) or as plain text.",
        case_sensitive=False,
    ),
]
LogLevelOption = Annotated[
    LogLevel,
    typer.Option(
        "--log-level",
        envvar="ONCELY_LOG_LEVEL",
        help="The lowest level logged.",
        case_sensitive=False,
    ),
]


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h`` or ``7d`` as a ``timedelta``; ``typer.BadParameter`` otherwise."""
    try:
        return durations.parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def parse_moment(text: str) -> datetime:
    """An ISO-8601 time (naive means UTC), or a duration (``15m``) meaning that long before now.

    Raises ``typer.BadParameter`` for anything else.
    """
    try:
        return durations.parse_moment(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


OlderThan = Annotated[
    str, typer.Option(help="Delete rows created longer ago than this (e.g. 7d, 12h).")
]

Execute = Annotated[
    bool,
    typer.Option(
        "--execute",
        help="Make the change. Without it the command is a dry run: it prints what it would "
        "change, and changes nothing.",
    ),
]
ExecuteNamed = Annotated[
    bool,
    typer.Option(
        "--execute",
        "--yes",
        help="Make the change (--yes is the same, for the ids named). Without it the command is "
        "a dry run: it prints what it would change, and changes nothing.",
    ),
]


def settings_epilog(settings: type[BaseSettings], what: str) -> str:
    """The ``--help`` epilog listing every field of ``settings`` with its environment variable."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    lines = [f"Every {what} setting also reads its environment variable:"]
    for name, field in settings.model_fields.items():
        lines.append(f"  {prefix}{name.upper()}: {field.description} (default {field.default})")
    return "\n\n".join(lines)


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def settings_with(
    model: type[SettingsT],
    options: Mapping[str, Any],
    *,
    names: Mapping[str, str] | None = None,
) -> SettingsT:
    """``model`` read from its ``ONCELY_*`` variables, with the command-line options given
    (``options`` by field; ``None`` is not given) over them.

    An option the model refuses is a usage error naming the option (``names`` maps a field to
    its option when that is not ``--field-name``); a variable it refuses raises the
    ``ValidationError``, which the boundary reports naming the variable.
    """
    given = {field: value for field, value in options.items() if value is not None}
    try:
        return model(**given)
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            if field in given:
                option = (names or {}).get(field, "--" + field.replace("_", "-"))
                raise typer.BadParameter(
                    f"{error['msg']} (given: {given[field]})", param_hint=option
                ) from None
        raise
