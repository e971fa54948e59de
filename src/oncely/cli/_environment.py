"""Unknown ``ONCELY_*`` environment variables: a misspelt one would be ignored in silence."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

import typer
from pydantic_settings import BaseSettings

from oncely import settings

#: ``ONCELY_*`` names read outside the settings models and the command-line options.
OTHER_VARIABLES = frozenset(
    {
        "ONCELY_CACHE_DIR",
        "ONCELY_DEBUG",
        "ONCELY_FAILPOINTS",
        "ONCELY_TEST_DATABASE_URL",
        "ONCELY_TEST_KAFKA",
    }
)


def _settings_variables() -> Iterator[str]:
    for model in vars(settings).values():
        if not (isinstance(model, type) and issubclass(model, BaseSettings)):
            continue
        prefix = str(model.model_config.get("env_prefix", ""))
        for name, field in model.model_fields.items():
            alias = field.validation_alias if isinstance(field.validation_alias, str) else None
            yield (alias or prefix + name).upper()


def _option_variables(command: Any) -> Iterator[str]:
    for param in command.params:
        envvar = param.envvar
        yield from [envvar] if isinstance(envvar, str) else envvar or []
    for child in (getattr(command, "commands", None) or {}).values():
        yield from _option_variables(child)


def known_variables(app: typer.Typer) -> frozenset[str]:
    """Every ``ONCELY_*`` name oncely reads: settings, ``app``'s options, and the others."""
    options = _option_variables(typer.main.get_command(app))
    return frozenset({*_settings_variables(), *options, *OTHER_VARIABLES})


def unknown_variables(environ: Mapping[str, str], known: frozenset[str]) -> list[str]:
    """A warning for each ``ONCELY_*`` variable of ``environ`` oncely does not read, naming
    the closest known one."""
    warnings = []
    for name in sorted(n for n in environ if n.startswith("ONCELY_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"warning: {name} is not an oncely setting{hint}; it is ignored")
    return warnings
