"""Small effects apps for the tests, each importable by a process (``tests.apps.<name>:effects``);
what they have in common is here."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from pydantic import BaseModel

from oncely.consumers.effects import Effects
from oncely.events import Registry


@dataclass
class EffectsApp:
    """An app's registry and effects, and the model of the one event type its effects apply."""

    registry: Registry
    effects: Effects
    model: type[BaseModel]

    @property
    def topic(self) -> str:
        return self.registry.for_model(self.model).topic


def create_schema(engine: sa.Engine, schema: str) -> None:
    """Run the app's ``CREATE TABLE IF NOT EXISTS`` statements ``schema`` in one transaction."""
    with engine.begin() as conn:
        conn.exec_driver_sql(schema)
