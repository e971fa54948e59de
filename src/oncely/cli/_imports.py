"""Load an application object named ``package.module:attribute`` (as uvicorn and celery do)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from oncely.consumers.effects import Effects
from oncely.errors import ConfigurationError

__all__ = ["ImportTargetError", "load_effects", "load_object"]


class ImportTargetError(ConfigurationError):
    """The object named on the command line could not be loaded."""


def load_object(target: str) -> object:
    """Import ``package.module:attribute`` and return the attribute (it may be dotted).

    The current directory is importable, as with ``python -m``, so an application's own
    packages load from where the command runs.

    Raises:
        ImportTargetError: the target is malformed, the module does not import (the message
            carries the import error) or lacks the attribute; the message names the target.
    """
    module_name, separator, attribute = target.partition(":")
    if not separator or not module_name or not attribute:
        raise ImportTargetError(f"{target!r} is not of the form 'package.module:attribute'")
    here = str(Path.cwd())
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportTargetError(
            f"cannot import module {module_name!r} of {target!r}: {exc}"
        ) from exc
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ImportTargetError(
                f"module {module_name!r} has no attribute {attribute!r} (looking for {target!r})"
            ) from None
    return found


def load_effects(target: str) -> Effects:
    """:func:`load_object`, checked to be an oncely ``Effects`` app.

    Raises:
        ImportTargetError: as :func:`load_object`, or the object is something else.
    """
    effects = load_object(target)
    if not isinstance(effects, Effects):
        raise ImportTargetError(f"{target} is a {type(effects).__name__}, not oncely Effects")
    return effects
