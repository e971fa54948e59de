"""The orders service's oncely declarations as one target: ``--app examples.fastapi.app:app``."""

from __future__ import annotations

import oncely
from examples.fastapi.effects import effects
from examples.fastapi.events import registry

app = oncely.App(registry=registry, effects=effects)
