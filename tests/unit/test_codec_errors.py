"""Every way a value can fail to decode raises DecodeError naming the cause; encode refusals too."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID, uuid4

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError
from pydantic import BaseModel, Field

from oncely.errors import ConfigurationError, OncelyError
from oncely.events import Encoding, Registry, UnknownEventTypeError
from oncely.schemas import single_object
from oncely.schemas.catalog import SchemaCatalog, SchemaEntry
from oncely.schemas.codec import Codec
from oncely.schemas.errors import CatalogError, DecodeError, DecodeFailure, EncodeError

Money = Annotated[Decimal, Field(max_digits=18, decimal_places=2, gt=0)]


class Paid(BaseModel):
    payment_id: UUID
    amount: Money
    at: datetime


class Refunded(BaseModel):
    payment_id: UUID
    count: int = 0


def paid() -> Paid:
    return Paid(payment_id=uuid4(), amount=Decimal("12.30"), at=datetime.now(UTC))


def codec_for(encoding: Encoding = "avro", **codec_args: Any) -> Codec:
    registry = Registry()
    registry.register(Paid, name="payment.paid", key="payment_id", aggregate="p", encoding=encoding)
    registry.register(Refunded, name="payment.refunded", key="payment_id", aggregate="p")
    client = SchemaRegistryClient.new_client({"url": f"mock://errors-{encoding}"})
    return Codec(registry=registry, schema_registry=client, auto_register=True, **codec_args)


def decode_error(codec: Codec, value: bytes, headers: Any = None, **kwargs: Any) -> DecodeError:
    with pytest.raises(DecodeError) as caught:
        codec.decode(value, headers, **kwargs)
    assert isinstance(caught.value, OncelyError)
    return caught.value


@pytest.mark.parametrize(
    ("mangle", "cause"),
    [
        (lambda value: value[:-3], "body does not decode"),
        (lambda value: value + b"\x00", "1 trailing bytes"),
        (lambda value: value[:6], "too short for an Avro single-object header"),
        (lambda value: b"\xc3\x02" + value[2:], "not the Avro single-object marker"),
    ],
)
def test_corrupt_single_object_value(mangle: Any, cause: str) -> None:
    codec = codec_for()
    value, headers = codec.encode(paid())
    error = decode_error(codec, mangle(value), headers, expected=Paid)
    assert error.reason is DecodeFailure.CORRUPT
    assert cause in str(error)


def test_unknown_fingerprint() -> None:
    codec = codec_for()
    value, headers = codec.encode(paid())
    forged = single_object.frame(b"\x01" * 8, value[10:])
    error = decode_error(codec, forged, headers, expected=Paid)
    assert error.reason is DecodeFailure.UNKNOWN_SCHEMA
    assert "fingerprint 0101010101010101" in str(error)


def test_unknown_fingerprint_without_any_hint_cannot_name_the_type() -> None:
    codec = codec_for()
    error = decode_error(codec, single_object.frame(b"\x01" * 8, b""))
    assert error.reason is DecodeFailure.UNKNOWN_EVENT_TYPE


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [
        ("application/json", "avro"),
        ("application/vnd.oncely.avro", "json"),
        ("application/vnd.confluent.avro", "avro"),
        ("text/plain", "avro"),
    ],
)
def test_wrong_content_type(content_type: str, encoding: Encoding) -> None:
    codec = codec_for(encoding)
    value, headers = codec.encode(paid())
    error = decode_error(codec, value, {**headers, "content-type": content_type}, expected=Paid)
    assert error.reason is DecodeFailure.CONTENT_TYPE
    assert f"content-type {content_type!r}" in str(error)


def test_missing_content_type_falls_back_to_the_registered_encoding() -> None:
    codec = codec_for("json")
    value, _ = codec.encode(paid())
    assert isinstance(codec.decode(value, {"eventType": "payment.paid"}), Paid)


def test_validation_failure_after_avro_decoding() -> None:
    codec = codec_for()
    invalid = Paid.model_construct(
        payment_id=uuid4(), amount=Decimal("-5.00"), at=datetime.now(UTC)
    )
    value, headers = codec.encode(invalid)
    error = decode_error(codec, value, headers, expected=Paid)
    assert error.reason is DecodeFailure.INVALID
    assert "does not validate as Paid" in str(error)
    assert "amount" in str(error)


def test_validation_failure_of_json() -> None:
    codec = codec_for("json")
    value = b'{"payment_id": "not-a-uuid", "amount": "1.00", "at": "2024-01-01T00:00:00Z"}'
    error = decode_error(codec, value, expected=Paid)
    assert error.reason is DecodeFailure.INVALID
    assert "payment_id" in str(error)


@pytest.mark.parametrize("value", [b"{not json", b"\xff\xfe", b""])
def test_broken_json_is_corrupt(value: bytes) -> None:
    error = decode_error(codec_for("json"), value, expected=Paid)
    assert error.reason is DecodeFailure.CORRUPT


def test_unknown_event_type_header() -> None:
    error = decode_error(codec_for("json"), b"{}", {"eventType": "payment.lost"})
    assert error.reason is DecodeFailure.UNKNOWN_EVENT_TYPE
    assert "no durable topic registered for event type 'payment.lost'" in str(error)


def test_json_without_type_information() -> None:
    codec = codec_for("json")
    value, headers = codec.encode(paid())
    error = decode_error(codec, value, headers)
    assert error.reason is DecodeFailure.UNKNOWN_EVENT_TYPE
    assert "no 'eventType' header" in str(error)


def test_header_naming_another_type_than_expected() -> None:
    codec = codec_for()
    value, headers = codec.encode(paid())
    error = decode_error(codec, value, {**headers, "eventType": "payment.refunded"}, expected=Paid)
    assert error.reason is DecodeFailure.WRONG_EVENT_TYPE
    assert "'payment.refunded' event, expected 'payment.paid'" in str(error)


def test_payload_of_another_type_than_expected() -> None:
    codec = codec_for()
    value, _ = codec.encode(Refunded(payment_id=uuid4()))
    error = decode_error(codec, value, expected=Paid)
    assert error.reason is DecodeFailure.WRONG_EVENT_TYPE
    assert "written as 'payment.refunded' v1" in str(error)


def test_non_utf8_header() -> None:
    codec = codec_for()
    value, _ = codec.encode(paid())
    error = decode_error(codec, value, [("content-type", b"\xff")], expected=Paid)
    assert error.reason is DecodeFailure.CORRUPT
    assert "header 'content-type'" in str(error)


def test_confluent_unknown_schema_id() -> None:
    codec = codec_for("avro-confluent")
    value, headers = codec.encode(paid())
    forged = b"\x00" + (99999).to_bytes(4, "big") + value[5:]
    error = decode_error(codec, forged, headers, expected=Paid)
    assert error.reason is DecodeFailure.UNKNOWN_SCHEMA
    assert "no schema with id 99999" in str(error)


@pytest.mark.parametrize(
    ("mangle", "cause"),
    [
        (lambda value: b"\x01" + value[1:], "not the Confluent magic byte"),
        (lambda value: value[:3], "too short for the Confluent header"),
        (lambda value: value[:7], "does not decode with schema id"),
    ],
)
def test_confluent_corrupt_value(mangle: Any, cause: str) -> None:
    codec = codec_for("avro-confluent")
    value, headers = codec.encode(paid())
    error = decode_error(codec, mangle(value), headers, expected=Paid)
    assert error.reason is DecodeFailure.CORRUPT
    assert cause in str(error)


class UnavailableRegistry:
    """A schema registry client whose server answers 503."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: object, **kwargs: object) -> None:
            raise SchemaRegistryError(503, 50301, "unavailable")

        return fail


def test_registry_outage_is_not_a_decode_error() -> None:
    value, headers = codec_for("avro-confluent").encode(paid())
    registry = Registry()
    registry.register(Paid, name="payment.paid", key="payment_id", aggregate="p",
                      encoding="avro-confluent")  # fmt: skip
    codec = Codec(registry=registry, schema_registry=UnavailableRegistry())  # type: ignore[arg-type]
    with pytest.raises(SchemaRegistryError) as caught:
        codec.decode(value, headers, expected=Paid)
    assert caught.value.http_status_code == 503


def test_naive_datetime_is_refused_naming_the_field() -> None:
    codec = codec_for()
    event = Paid(payment_id=uuid4(), amount=Decimal(1), at=datetime(2024, 1, 1))
    with pytest.raises(EncodeError, match=r"Paid\.at is a naive datetime"):
        codec.encode(event)


@pytest.mark.parametrize("encoding", ["avro", "avro-confluent"])
def test_long_out_of_range_is_an_encode_error(encoding: Encoding) -> None:
    registry = Registry()
    registry.register(
        Refunded, name="payment.refunded", key="payment_id", aggregate="p", encoding=encoding
    )
    client = SchemaRegistryClient.new_client({"url": "mock://errors-range"})
    codec = Codec(registry=registry, schema_registry=client, auto_register=True)
    with pytest.raises(EncodeError, match=r"'payment\.refunded'"):
        codec.encode(Refunded(payment_id=uuid4(), count=2**63))


def test_json_bytes_that_are_not_text_is_an_encode_error() -> None:
    class Blob(BaseModel):
        id: int
        data: bytes

    registry = Registry()
    registry.register(Blob, name="blob", key="id", aggregate="b", encoding="json")
    with pytest.raises(EncodeError, match=r"'blob'"):
        Codec(registry=registry).encode(Blob(id=1, data=b"\xff"))


def test_unregistered_model_cannot_be_encoded() -> None:
    class Stray(BaseModel):
        id: int

    with pytest.raises(UnknownEventTypeError, match=r"Stray"):
        codec_for().encode(Stray(id=1))


def test_unregistered_expected_model() -> None:
    class Stray(BaseModel):
        id: int

    with pytest.raises(UnknownEventTypeError, match=r"Stray"):
        codec_for().decode(b"", expected=Stray)


def test_confluent_encoding_needs_a_schema_registry_client() -> None:
    registry = Registry()
    registry.register(Paid, name="payment.paid", key="payment_id", aggregate="p",
                      encoding="avro-confluent")  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"payment.paid use avro-confluent"):
        Codec(registry=registry)


def test_committed_version_must_match_the_code() -> None:
    class PaidV1(BaseModel):
        payment_id: UUID

    old = Registry().register(PaidV1, name="payment.paid", key="payment_id", aggregate="p")
    with pytest.raises(CatalogError, match=r"'payment.paid' v1 differs from the committed"):
        codec_for(catalog=SchemaCatalog([SchemaEntry.of(old)]))


def test_decode_error_keeps_reason_and_pickles() -> None:
    error = DecodeError(DecodeFailure.CORRUPT, "bad bytes")
    assert str(error) == "cannot decode event (corrupt): bad bytes"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.reason, copy.detail) == (DecodeFailure.CORRUPT, "bad bytes")
