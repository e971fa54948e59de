"""Every supported field type survives encode -> decode, in all three encodings."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from enum import StrEnum
from typing import Annotated
from uuid import UUID

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from oncely.events import Encoding, Registry
from oncely.schemas.codec import Codec

Money = Annotated[Decimal, Field(max_digits=18, decimal_places=2)]
Rate = Annotated[Decimal, Field(max_digits=9, decimal_places=9)]
LONG = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOAT = st.floats(allow_nan=False, allow_infinity=False)


class Kind(StrEnum):
    DEPOSIT = "deposit"
    WITHDRAWAL = "withdrawal"


class Part(BaseModel):
    label: str
    weight: float
    kind: Kind | None = None


class Everything(BaseModel):
    # JSON carries bytes as base64 (pydantic's default is UTF-8 text, which not all bytes are).
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    id: UUID
    text: str
    count: int
    ratio: float
    flag: bool
    raw: bytes
    price: Money
    rate: Rate
    at: AwareDatetime
    plain_at: datetime
    day: date
    kind: Kind
    part: Part
    parts: list[Part]
    scores: dict[str, int]
    matrix: list[list[float]]
    note: str | None = None
    maybe_price: Money | None = None
    maybe_part: Part | None = None
    maybe_day: date | None = None
    tags: list[str] = Field(default_factory=list)


def aware_datetimes() -> st.SearchStrategy[datetime]:
    offsets = st.integers(min_value=-23 * 60, max_value=23 * 60).map(
        lambda minutes: timezone(timedelta(minutes=minutes))
    )
    return st.datetimes(
        min_value=datetime(1000, 1, 1),
        max_value=datetime(9000, 1, 1),
        timezones=st.one_of(st.just(UTC), offsets),
    )


def decimals(places: int, digits: int) -> st.SearchStrategy[Decimal]:
    bound = Decimal(10) ** (digits - places) - Decimal(1).scaleb(-places)
    return st.decimals(
        min_value=-bound, max_value=bound, places=places, allow_nan=False, allow_infinity=False
    )


parts = st.builds(Part, label=st.text(), weight=FLOAT, kind=st.none() | st.sampled_from(Kind))
everything = st.builds(
    Everything,
    id=st.uuids(),
    text=st.text(),
    count=LONG,
    ratio=FLOAT,
    flag=st.booleans(),
    raw=st.binary(),
    price=decimals(2, 18),
    rate=decimals(9, 9),
    at=aware_datetimes(),
    plain_at=aware_datetimes(),
    day=st.dates(),
    kind=st.sampled_from(Kind),
    part=parts,
    parts=st.lists(parts, max_size=3),
    scores=st.dictionaries(st.text(), LONG, max_size=3),
    matrix=st.lists(st.lists(FLOAT, max_size=3), max_size=3),
    note=st.none() | st.text(),
    maybe_price=st.none() | decimals(2, 18),
    maybe_part=st.none() | parts,
    maybe_day=st.none() | st.dates(),
    tags=st.lists(st.text(), max_size=3),
)


def make_codec(encoding: Encoding) -> Codec:
    registry = Registry()
    registry.register(
        Everything, name="everything.happened", key="id", aggregate="everything", encoding=encoding
    )
    client = SchemaRegistryClient.new_client({"url": f"mock://roundtrip-{encoding}"})
    return Codec(registry=registry, schema_registry=client, auto_register=True)


CODECS = {encoding: make_codec(encoding) for encoding in ("avro", "avro-confluent", "json")}


def _by_expected_type(codec: Codec, value: bytes, headers: dict[str, str]) -> BaseModel:
    return codec.decode(value, headers, expected=Everything)


def _by_event_type_header(codec: Codec, value: bytes, headers: dict[str, str]) -> BaseModel:
    kafka_headers = [("eventType", b"everything.happened")] + [
        (name, text.encode()) for name, text in headers.items()
    ]
    return codec.decode(value, kafka_headers)


@pytest.mark.parametrize(
    "decode", [_by_expected_type, _by_event_type_header], ids=["expected", "event-type-header"]
)
@pytest.mark.parametrize("encoding", list(CODECS))
@settings(max_examples=150, deadline=None)
@given(event=everything)
def test_round_trip(
    encoding: Encoding,
    decode: Callable[[Codec, bytes, dict[str, str]], BaseModel],
    event: Everything,
) -> None:
    codec = CODECS[encoding]
    value, headers = codec.encode(event)
    decoded = decode(codec, value, headers)
    assert decoded == event
    assert isinstance(decoded, Everything)
    assert decoded.at.utcoffset() is not None


@settings(max_examples=25, deadline=None)
@given(event=everything)
def test_single_object_needs_no_headers(event: Everything) -> None:
    codec = CODECS["avro"]
    value, _ = codec.encode(event)
    assert codec.decode(value) == event


def test_avro_timestamps_come_back_in_utc() -> None:
    codec = CODECS["avro"]
    paris = timezone(timedelta(hours=2))
    local = Everything(
        id=UUID(int=1), text="", count=0, ratio=0.0, flag=False, raw=b"", price=Decimal(0),
        rate=Decimal("0.5"), at=datetime(2024, 5, 1, 12, tzinfo=paris), plain_at=datetime.now(UTC),
        day=date.today(), kind=Kind.DEPOSIT, part=Part(label="", weight=0), parts=[], scores={},
        matrix=[],
    )  # fmt: skip
    decoded = codec.decode(codec.encode(local)[0], expected=Everything)
    assert decoded.at == datetime(2024, 5, 1, 10, tzinfo=UTC)
    assert decoded.at.utcoffset() == timedelta(0)
