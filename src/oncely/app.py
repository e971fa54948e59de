"""``App``: an application's oncely declarations in one object, the target every command names
with ``--app module:attribute`` (``ONCELY_APP``)."""

from __future__ import annotations

from dataclasses import dataclass

from oncely.consumers.effects import Effects
from oncely.errors import ConfigurationError
from oncely.events import Registry
from oncely.tasks import Tasks


class AppError(ConfigurationError):
    """An application target is not what the command needs (the message says what to name)."""


@dataclass(frozen=True)
class App:
    """The event registry, the effects and the tasks of one application::

        app = oncely.App(registry=registry, effects=effects, tasks=tasks)

    then ``oncely consume --app payments.app:app --effect send-receipt``, ``oncely tasks run
    --app payments.app:app``, ``oncely schemas check --app payments.app:app``. ``registry``
    defaults to the effects' own. Raises :class:`AppError` when ``effects`` are declared over
    another registry than ``registry``.
    """

    registry: Registry | None = None
    effects: Effects | None = None
    tasks: Tasks | None = None

    def __post_init__(self) -> None:
        if self.effects is None:
            return
        if self.registry is None:
            object.__setattr__(self, "registry", self.effects.registry)
        elif self.effects.registry is not self.registry:
            raise AppError(
                "App: the effects are declared over another Registry than registry=; pass "
                "the Registry the effects were built with (or leave registry= out)"
            )

    @classmethod
    def of(cls, target: str, loaded: object) -> App:
        """``loaded`` (the object ``target`` names) as an App: an ``App`` itself, or the
        ``Registry``, ``Effects`` or ``Tasks`` object that targets named before ``App``.

        Raises :class:`AppError` for any other object.
        """
        if isinstance(loaded, App):
            return loaded
        if isinstance(loaded, Effects):
            return cls(effects=loaded)
        if isinstance(loaded, Registry):
            return cls(registry=loaded)
        if isinstance(loaded, Tasks):
            return cls(tasks=loaded)
        raise AppError(
            f"{target} is a {type(loaded).__name__}; name an oncely.App (or a Registry, "
            "Effects or Tasks object)"
        )

    def require_registry(self, target: str) -> Registry:
        """The registry; :class:`AppError` naming ``target`` when it has none."""
        if self.registry is None:
            raise AppError(f"{target} declares no event Registry; give its App registry=")
        return self.registry

    def require_effects(self, target: str) -> Effects:
        """The effects; :class:`AppError` naming ``target`` when it has none."""
        if self.effects is None:
            raise AppError(f"{target} declares no effects; give its App effects=")
        return self.effects

    def require_tasks(self, target: str) -> Tasks:
        """The tasks; :class:`AppError` naming ``target`` when it has none."""
        if self.tasks is None:
            raise AppError(f"{target} declares no tasks; give its App tasks=")
        return self.tasks
