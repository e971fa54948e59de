"""The payments example as one application target: ``--app examples.payments.app:app``."""

from __future__ import annotations

import oncely
from examples.payments.effects import effects
from examples.payments.events import registry
from examples.payments.tasks import tasks

app = oncely.App(registry=registry, effects=effects, tasks=tasks)
