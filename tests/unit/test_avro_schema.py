"""pydantic model -> Avro schema: every supported type, names, defaults, and refusals."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from decimal import Decimal
from enum import Enum, StrEnum
from typing import Annotated, Any, Literal, Optional
from uuid import UUID

import avro.schema
import fastavro
import pytest
from pydantic import AwareDatetime, BaseModel, Field, condecimal

from oncely.events.avro import SchemaDerivationError, avro_namespace, event_schema, record_name

Money = Annotated[Decimal, Field(max_digits=18, decimal_places=2)]


class Color(StrEnum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    """Where someone lives."""

    street: str
    zip_code: str | None = None


def field_type(model: type[BaseModel], name: str) -> Any:
    schema = event_schema(model, event_type="test.event")
    return next(field for field in schema["fields"] if field["name"] == name)


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (str, "string"),
        (int, "long"),
        (float, "double"),
        (bool, "boolean"),
        (bytes, "bytes"),
        (UUID, {"type": "string", "logicalType": "uuid"}),
        (datetime, {"type": "long", "logicalType": "timestamp-micros"}),
        (AwareDatetime, {"type": "long", "logicalType": "timestamp-micros"}),
        (date, {"type": "int", "logicalType": "date"}),
        (Money, {"type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 2}),
        (
            condecimal(max_digits=5, decimal_places=0),
            {"type": "bytes", "logicalType": "decimal", "precision": 5, "scale": 0},
        ),
        (list[int], {"type": "array", "items": "long"}),
        (dict[str, float], {"type": "map", "values": "double"}),
        (list[Money], {"type": "array", "items": {
            "type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 2}}),
        (Color, {"type": "enum", "name": "Color", "symbols": ["red", "green"]}),
        (Annotated[str, Field(min_length=2)], "string"),
        (str | None, ["null", "string"]),
        (Optional[int], ["null", "long"]),  # noqa: UP045 - the typing spelling is supported too
        (Money | None, ["null", {
            "type": "bytes", "logicalType": "decimal", "precision": 18, "scale": 2}]),
        (list[dict[str, UUID | None]], {"type": "array", "items": {"type": "map", "values": [
            "null", {"type": "string", "logicalType": "uuid"}]}}),
    ],
)  # fmt: skip
def test_field_types_map_to_avro(annotation: Any, expected: Any) -> None:
    class Event(BaseModel):
        value: annotation

    assert field_type(Event, "value")["type"] == expected


def test_decimal_declared_on_the_field() -> None:
    class Event(BaseModel):
        value: Decimal = Field(max_digits=10, decimal_places=4)
        maybe: Decimal | None = Field(default=None, max_digits=6, decimal_places=1)

    assert field_type(Event, "value")["type"]["scale"] == 4
    assert field_type(Event, "maybe")["type"][1]["precision"] == 6


def test_nested_model_is_a_record_defined_once_then_named() -> None:
    class Person(BaseModel):
        home: Address
        work: Address | None = None
        previous: list[Address] = Field(default_factory=list)

    schema = event_schema(Person, event_type="person.moved")
    home, work, previous = schema["fields"]
    assert home["type"] == {
        "type": "record",
        "name": "Address",
        "doc": "Where someone lives.",
        "fields": [
            {"name": "street", "type": "string"},
            {"name": "zip_code", "type": ["null", "string"], "default": None},
        ],
    }
    assert work == {"name": "work", "type": ["null", "Address"], "default": None}
    assert previous == {"name": "previous", "type": {"type": "array", "items": "Address"},
                        "default": []}  # fmt: skip


def test_top_level_names_come_from_the_event_type() -> None:
    class Renamed(BaseModel):
        """Docs become the record doc."""

        id: int = Field(description="the id")

    schema = event_schema(Renamed, event_type="transfer.completed")
    assert schema["type"] == "record"
    assert schema["name"] == "TransferCompleted"
    assert schema["namespace"] == "transfer.completed"
    assert schema["doc"] == "Docs become the record doc."
    assert schema["fields"] == [{"name": "id", "type": "long", "doc": "the id"}]


@pytest.mark.parametrize(
    ("event_type", "namespace", "name"),
    [
        ("transfer.completed", "transfer.completed", "TransferCompleted"),
        ("user-signup.v2.done", "user_signup.v2.done", "UserSignupV2Done"),
        ("2fa.sent", "_2fa.sent", "_2faSent"),
        ("a_b", "a_b", "AB"),
    ],
)
def test_names_are_valid_avro_names(event_type: str, namespace: str, name: str) -> None:
    assert avro_namespace(event_type) == namespace
    assert record_name(event_type) == name


def test_defaults_are_rendered_in_avro_json_form() -> None:
    class Event(BaseModel):
        count: int = 3
        ratio: float = 0.5
        flag: bool = True
        label: str = "x"
        raw: bytes = b"\x00\xff"
        price: Money = Decimal("-1.50")
        color: Color = Color.GREEN
        uid: UUID = UUID("12345678-1234-5678-1234-567812345678")
        at: datetime = datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)
        day: date = date(1970, 1, 11)
        tags: list[str] = Field(default_factory=list)
        extra: dict[str, int] = Field(default_factory=dict)
        nickname: str | None = "bob"
        address: Address = Address(street="Main")

    schema = event_schema(Event, event_type="e")
    defaults = {field["name"]: field["default"] for field in schema["fields"]}
    assert defaults == {
        "count": 3,
        "ratio": 0.5,
        "flag": True,
        "label": "x",
        "raw": "\u0000\u00ff",
        "price": "\u00ff\u006a",  # -150 as 16-bit big-endian two's complement
        "color": "green",
        "uid": "12345678-1234-5678-1234-567812345678",
        "at": 1_000_000,
        "day": 10,
        "tags": [],
        "extra": {},
        "nickname": "bob",
        "address": {"street": "Main", "zip_code": None},
    }
    assert field_type(Event, "nickname")["type"] == ["string", "null"]
    fastavro.parse_schema(schema)
    avro.schema.parse(json.dumps(schema))


def test_non_deterministic_default_factories_give_no_default() -> None:
    class Event(BaseModel):
        at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    assert "default" not in field_type(Event, "at")


class Loop(BaseModel):
    name: str
    children: list[Loop] = Field(default_factory=list)


def test_recursive_models_refer_to_themselves() -> None:
    schema = event_schema(Loop, event_type="tree.grown")
    assert schema["fields"][1]["type"] == {"type": "array", "items": "TreeGrown"}
    fastavro.parse_schema(schema)


class Plain(Enum):
    ONE = 1


class Spaced(StrEnum):
    BAD = "not a name"


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (Decimal, r"Event\.value: a Decimal needs its precision and scale declared"),
        (Annotated[Decimal, Field(max_digits=4)], "precision and scale declared"),
        (Annotated[Decimal, Field(decimal_places=2)], "precision and scale declared"),
        (int | str, r"Event\.value: only `X \| None` unions"),
        (tuple[int, int], r"Event\.value: type .* has no Avro mapping"),
        (set[int], "has no Avro mapping"),
        (Any, "has no Avro mapping"),
        (Literal["a"], "has no Avro mapping"),
        (list, "has no Avro mapping"),
        (dict[int, str], r"Event\.value: Avro map keys are strings"),
        (Plain, "member ONE has a int value"),
        (Spaced, "'not a name' is not a valid Avro name"),
        (list[Decimal], r"Event\.value\[\]: a Decimal needs"),
    ],
)
def test_unmappable_fields_are_named(annotation: Any, message: str) -> None:
    class Event(BaseModel):
        value: annotation

    with pytest.raises(SchemaDerivationError, match=message):
        event_schema(Event, event_type="e")


def test_two_classes_with_one_name_are_refused() -> None:
    class Address2(BaseModel):
        city: str

    Address2.__name__ = "Address"

    class Event(BaseModel):
        a: Address
        b: Address2

    with pytest.raises(SchemaDerivationError, match=r"Avro name 'Address' is already used"):
        event_schema(Event, event_type="e")


def test_default_that_does_not_fit_is_named() -> None:
    class Event(BaseModel):
        price: Money = Decimal("1.234")

    with pytest.raises(SchemaDerivationError, match=r"Event\.price: default"):
        event_schema(Event, event_type="e")


def test_naive_datetime_default_is_refused() -> None:
    class Event(BaseModel):
        at: datetime = datetime(2020, 1, 1)

    with pytest.raises(SchemaDerivationError, match=r"naive datetime"):
        event_schema(Event, event_type="e")


def test_scale_above_precision_is_refused() -> None:
    class Event(BaseModel):
        value: Annotated[Decimal, Field(max_digits=2, decimal_places=3)]

    with pytest.raises(SchemaDerivationError, match=r"decimal_places .3. exceeds max_digits .2."):
        event_schema(Event, event_type="e")


def test_field_names_must_be_avro_names() -> None:
    class Event(BaseModel):
        ñame: str

    with pytest.raises(SchemaDerivationError, match=r"'ñame' is not a valid Avro name"):
        event_schema(Event, event_type="e")


def test_schema_is_deterministic() -> None:
    first = json.dumps(event_schema(Loop, event_type="a"))
    assert json.dumps(event_schema(Loop, event_type="a")) == first


def test_apache_avro_parses_every_logical_type_without_warnings() -> None:
    class Event(BaseModel):
        a: Money
        b: UUID
        c: AwareDatetime
        d: date
        e: Color
        f: Address

    parsed = avro.schema.parse(json.dumps(event_schema(Event, event_type="e")))
    assert isinstance(parsed, avro.schema.RecordSchema)
    assert [field.name for field in parsed.fields] == ["a", "b", "c", "d", "e", "f"]
