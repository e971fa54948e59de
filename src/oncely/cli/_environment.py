"""Unknown ``ONCELY_*`` environment variables: a misspelt one would be ignored in silence."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic_settings import BaseSettings

from oncely import settings

#: ``ONCELY_*`` names the command-line options read (a test holds this to the options, so that
#: the check needs no command imported).
OPTION_VARIABLES = frozenset(
    {
        "ONCELY_APP",
        "ONCELY_ASYNCAPI_OUTPUT",
        "ONCELY_ASYNCAPI_TITLE",
        "ONCELY_ASYNCAPI_VERSION",
        "ONCELY_DATABASE_SCHEMA",
        "ONCELY_DATABASE_URL",
        "ONCELY_DEVSTACK_BROKERS",
        "ONCELY_DEVSTACK_DIR",
        "ONCELY_DEVSTACK_KAFKA_VERSION",
        "ONCELY_KAFKA_BOOTSTRAP_SERVERS",
        "ONCELY_LOG_FORMAT",
        "ONCELY_LOG_LEVEL",
        "ONCELY_REGISTRY",
        "ONCELY_RELAY_CLOUDEVENTS_SOURCE",
        "ONCELY_SCHEMAS_DIR",
        "ONCELY_SCHEMAS_MODE",
        "ONCELY_SCHEMAS_TRANSITIVE",
        "ONCELY_SCHEMA_REGISTRY_URL",
    }
)
#: ``ONCELY_*`` names read outside the settings models and the command-line options.
OTHER_VARIABLES = frozenset(
    {
        "ONCELY_CACHE_DIR",
        "ONCELY_DEBUG",
        "ONCELY_FAILPOINTS",
        "ONCELY_TEST_DATABASE_URL",
        "ONCELY_TEST_IMAGE",
        "ONCELY_TEST_KAFKA",
        "ONCELY_TEST_KAFKA_IMAGE",
        "ONCELY_TEST_POSTGRES_IMAGE",
        "ONCELY_TEST_SCHEMA_REGISTRY_URL",
        "ONCELY_TEST_SERVICES",
        # docker-compose.yml's image names
        "ONCELY_CONNECT_IMAGE",
        "ONCELY_IMAGE",
        "ONCELY_KAFKA_IMAGE",
        "ONCELY_POSTGRES_IMAGE",
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
        if issubclass(model, settings.RenamableSettings):
            yield from model.renamed_variables()


def option_variables(command: Any) -> Iterator[str]:
    """The ``ONCELY_*`` names ``command``'s options and its subcommands' read (it loads them)."""
    for param in command.params:
        envvar = param.envvar
        yield from [envvar] if isinstance(envvar, str) else envvar or []
    for child in (getattr(command, "commands", None) or {}).values():
        yield from option_variables(child)


def known_variables() -> frozenset[str]:
    """Every ``ONCELY_*`` name oncely reads: settings, options, and the others."""
    return frozenset({*_settings_variables(), *OPTION_VARIABLES, *OTHER_VARIABLES})


def unknown_variables(environ: Mapping[str, str], known: frozenset[str]) -> list[str]:
    """A warning for each ``ONCELY_*`` variable of ``environ`` oncely does not read, naming
    the closest known one."""
    warnings = []
    for name in sorted(n for n in environ if n.startswith("ONCELY_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"warning: {name} is not an oncely setting{hint}; it is ignored")
    return warnings
