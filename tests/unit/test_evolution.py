"""Schema evolution at run time: values written with one version decode with another."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated
from uuid import UUID, uuid4

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from pydantic import AwareDatetime, BaseModel, Field

from oncely.events import Encoding, Registry
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeError, DecodeFailure

Money = Annotated[Decimal, Field(max_digits=18, decimal_places=2)]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Status(StrEnum):
    OPEN = "open"
    SHUT = "shut"


# Nested records are named after their class: both versions are classes called "Line".
class LineV1(BaseModel):
    sku: str


class LineV2(BaseModel):
    sku: str
    price: Money = Decimal("9.99")


LineV1.__name__ = LineV2.__name__ = "Line"


class OrderV1(BaseModel):
    order_id: UUID
    total: Money
    placed_at: AwareDatetime
    lines: list[LineV1]


class OrderV2(BaseModel):
    order_id: UUID
    total: Money
    placed_at: AwareDatetime
    lines: list[LineV2]
    memo: str | None = None
    fee: Money = Decimal("-0.50")
    due: date = date(2030, 1, 2)
    settled_at: AwareDatetime = EPOCH
    blob: bytes = b"\x00\xfe"
    status: Status = Status.SHUT
    ref: UUID = UUID(int=7)
    tags: dict[str, int] = Field(default_factory=dict)


def declare(model: type[BaseModel], version: int, encoding: Encoding) -> Registry:
    registry = Registry()
    registry.register(
        model, name="order.placed", key="order_id", aggregate="o", version=version,
        encoding=encoding,
    )  # fmt: skip
    return registry


def entries(*registries: Registry) -> SchemaCatalog:
    return SchemaCatalog(SchemaEntry.of(event_type) for r in registries for event_type in r)


def order_v1() -> OrderV1:
    return OrderV1(
        order_id=uuid4(),
        total=Decimal("10.00"),
        placed_at=datetime(2024, 2, 29, 12, 30, tzinfo=UTC),
        lines=[LineV1(sku="a"), LineV1(sku="b")],
    )


@pytest.mark.parametrize("encoding", ["avro", "avro-confluent"])
def test_new_reader_takes_the_models_defaults_for_fields_the_writer_lacked(
    encoding: Encoding,
) -> None:
    v1, v2 = declare(OrderV1, 1, encoding), declare(OrderV2, 2, encoding)
    client = SchemaRegistryClient.new_client({"url": f"mock://evolution-{encoding}"})
    old = order_v1()
    value, headers = Codec(registry=v1, schema_registry=client, auto_register=True).encode(old)
    reader = Codec(registry=v2, catalog=entries(v1, v2), schema_registry=client)
    decoded = reader.decode(value, headers, expected=OrderV2)
    assert decoded == OrderV2(
        order_id=old.order_id,
        total=old.total,
        placed_at=old.placed_at,
        lines=[LineV2(sku="a"), LineV2(sku="b")],
    )
    assert decoded.fee == Decimal("-0.50")
    assert decoded.settled_at == EPOCH
    assert decoded.blob == b"\x00\xfe"


@pytest.mark.parametrize("encoding", ["avro", "avro-confluent"])
def test_old_reader_skips_fields_it_does_not_know(encoding: Encoding) -> None:
    v1, v2 = declare(OrderV1, 1, encoding), declare(OrderV2, 2, encoding)
    client = SchemaRegistryClient.new_client({"url": f"mock://evolution-fwd-{encoding}"})
    old = order_v1()
    new = OrderV2(**old.model_dump(exclude={"lines"}), lines=[LineV2(sku="a", price=Decimal(1))])
    value, headers = Codec(registry=v2, schema_registry=client, auto_register=True).encode(new)
    reader = Codec(registry=v1, catalog=entries(v1, v2), schema_registry=client)
    decoded = reader.decode(value, headers, expected=OrderV1)
    assert decoded == old.model_copy(update={"lines": [LineV1(sku="a")]})


class OrderNeedsMore(BaseModel):
    order_id: UUID
    total: Money
    placed_at: AwareDatetime
    lines: list[LineV1]
    customer: str


def test_new_required_field_cannot_read_old_values() -> None:
    v1, v3 = declare(OrderV1, 1, "avro"), declare(OrderNeedsMore, 3, "avro")
    value, headers = Codec(registry=v1).encode(order_v1())
    reader = Codec(registry=v3, catalog=entries(v1, v3))
    with pytest.raises(DecodeError) as caught:
        reader.decode(value, headers)
    assert caught.value.reason is DecodeFailure.INCOMPATIBLE_SCHEMA
    assert "does not resolve to 'order.placed' v3" in str(caught.value)


def test_json_evolves_through_the_model() -> None:
    v1, v2 = declare(OrderV1, 1, "json"), declare(OrderV2, 2, "json")
    old = order_v1()
    value, headers = Codec(registry=v1).encode(old)
    decoded = Codec(registry=v2).decode(value, headers, expected=OrderV2)
    assert decoded.lines == [LineV2(sku="a"), LineV2(sku="b")]
    assert decoded.status is Status.SHUT


def test_json_old_reader_ignores_fields_it_does_not_know() -> None:
    v1, v2 = declare(OrderV1, 1, "json"), declare(OrderV2, 2, "json")
    old = order_v1()
    new = OrderV2(
        **old.model_dump(exclude={"lines"}), lines=[LineV2(sku="a")], memo="hi", blob=b"ok"
    )
    value, headers = Codec(registry=v2).encode(new)
    decoded = Codec(registry=v1).decode(value, headers, expected=OrderV1)
    assert decoded == old.model_copy(update={"lines": [LineV1(sku="a")]})


def test_renaming_a_nested_class_breaks_resolution() -> None:
    class Line(BaseModel):
        sku: str

    class Renamed(BaseModel):
        order_id: UUID
        total: Money
        placed_at: AwareDatetime
        lines: list[Line]

    Line.__name__ = "OrderLine"
    v1, v2 = declare(OrderV1, 1, "avro"), declare(Renamed, 2, "avro")
    value, _ = Codec(registry=v1).encode(order_v1())
    with pytest.raises(DecodeError) as caught:
        Codec(registry=v2, catalog=entries(v1, v2)).decode(value)
    assert caught.value.reason is DecodeFailure.INCOMPATIBLE_SCHEMA
