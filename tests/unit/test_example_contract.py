"""The payments example's event types and their committed contract in schemas/ agree."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from uuid import uuid4

import pytest
from examples.payments.events import (
    FailureReason,
    TransferCompleted,
    TransferFailed,
    TransferRequested,
    registry,
)
from pydantic import ValidationError

from oncely.schemas.catalog import SchemaCatalog
from oncely.schemas.codec import Codec
from oncely.schemas.compatibility import CompatibilityMode, check_compatibility

SCHEMAS = Path(__file__).parents[2] / "schemas"


def test_types_topics_and_keys() -> None:
    assert [event_type.name for event_type in registry] == [
        "transfer.requested",
        "transfer.completed",
        "transfer.failed",
    ]
    assert registry.topics() == [
        "payments.transfer.completed",
        "payments.transfer.failed",
        "payments.transfer.requested",
    ]
    assert {event_type.key for event_type in registry} == {"transfer_id"}
    assert {event_type.aggregate for event_type in registry} == {"transfer"}


def test_every_current_version_is_committed_unchanged() -> None:
    catalog = SchemaCatalog.load(SCHEMAS)
    for event_type in registry:
        committed = catalog.find(event_type.name, event_type.version)
        assert committed is not None, f"run oncely schemas export for {event_type.name}"
        assert committed.schema == event_type.schema


def test_committed_history_is_fully_compatible() -> None:
    catalog = SchemaCatalog.load(SCHEMAS)
    mode = CompatibilityMode.FULL
    assert check_compatibility(registry, catalog, mode=mode, transitive=True) == []


def test_events_round_trip_through_the_committed_catalog() -> None:
    codec = Codec(registry=registry, catalog=SchemaCatalog.load(SCHEMAS))
    now = datetime.now(UTC)
    common = {"transfer_id": uuid4(), "from_account": "A-1", "to_account": "B-2",
              "amount": Decimal("1250.00"), "currency": "EUR"}  # fmt: skip
    events = [
        TransferRequested(**common, requested_at=now, reference="rent"),
        TransferCompleted(**common, completed_at=now, fee=Decimal("0.25")),
        TransferFailed(**common, reason=FailureReason.INSUFFICIENT_FUNDS, failed_at=now),
    ]
    for event in events:
        value, headers = codec.encode(event)
        assert codec.decode(value, headers) == event


def test_amounts_are_validated() -> None:
    with pytest.raises(ValidationError, match="amount"):
        TransferRequested(
            transfer_id=uuid4(), from_account="A", to_account="B", amount=Decimal("1.005"),
            currency="EUR", requested_at=datetime.now(UTC),
        )  # fmt: skip
