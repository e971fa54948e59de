"""Load an application object named ``package.module:attribute`` (as uvicorn and celery do), and
the part of its :class:`~oncely.app.App` a command needs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from oncely.errors import ConfigurationError

if TYPE_CHECKING:  # the application's parts load with it, when a command needs them
    from oncely.app import App
    from oncely.consumers.effects import Effects
    from oncely.events import Registry
    from oncely.tasks import Tasks

__all__ = [
    "ImportTargetError",
    "load_app",
    "load_effects",
    "load_object",
    "load_registry",
    "load_tasks",
]


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


def load_app(target: str) -> App:
    """The :class:`~oncely.app.App` ``target`` names (a ``Registry``, ``Effects`` or ``Tasks``
    object is taken as the App holding it).

    Raises:
        ImportTargetError: as :func:`load_object`.
        oncely.app.AppError: the object is none of those.
    """
    from oncely.app import App

    return App.of(target, load_object(target))


def load_effects(target: str) -> Effects:
    """The effects of the App ``target`` names; errors as :func:`load_app`, or ``AppError``
    when it has none."""
    return load_app(target).require_effects(target)


def load_registry(target: str) -> Registry:
    """The event registry of the App ``target`` names; errors as :func:`load_effects`."""
    return load_app(target).require_registry(target)


def load_tasks(target: str) -> Tasks:
    """The tasks of the App ``target`` names; errors as :func:`load_effects`."""
    return load_app(target).require_tasks(target)
