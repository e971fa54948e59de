"""What ``oncely status`` reports, as a test expects it."""

from __future__ import annotations

from typing import Any

from tests.apps import EffectsApp


def effect_status(app: EffectsApp, name: str, *, lag: int, **values: Any) -> dict[str, Any]:
    """The report's entry for ``app``'s effect ``name`` (its group, on the app's topic) with
    ``lag`` records behind: nothing applied and no dead letters unless ``values`` say so."""
    return {
        "effect": name,
        "group": app.effects.group_prefix + name,
        "topics": [app.topic],
        "applied": 0,
        "applied_last_minute": 0,
        "lag": lag,
        "dlq": 0,
        "duplicates_suppressed": None,
        **values,
    }
