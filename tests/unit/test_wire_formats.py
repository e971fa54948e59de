"""Golden bytes: CRC-64-AVRO fingerprints, the single-object header and Confluent framing.

The fingerprint constants are the Avro reference implementation's test vectors
(``share/test/data/schema-tests.txt`` in apache/avro, as signed 64-bit longs); each is also
recomputed here with the specification's reference algorithm, independently of fastavro.
"""

from __future__ import annotations

import json

import avro.schema
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from pydantic import BaseModel

from oncely.events import Registry
from oncely.events.avro import event_schema
from oncely.events.canonical import canonical_form, dump_avsc, fingerprint
from oncely.schemas import single_object
from oncely.schemas.codec import Codec
from oncely.schemas.confluent import schema_id
from oncely.schemas.errors import DecodeError, DecodeFailure

EMPTY = 0xC15D213AA4D7A795  # the CRC-64-AVRO seed, from the Avro specification


def _table() -> list[int]:
    table = []
    for byte in range(256):
        value = byte
        for _ in range(8):
            value = (value >> 1) ^ (EMPTY & -(value & 1))
        table.append(value)
    return table


TABLE = _table()


def reference_fingerprint64(data: bytes) -> int:
    """The Avro specification's ``fingerprint64``, transcribed to Python."""
    value = EMPTY
    for byte in data:
        value = (value >> 8) ^ TABLE[(value ^ byte) & 0xFF]
    return value


def as_signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# (schema, canonical form, fingerprint as Java's signed long) from the Avro test data.
VECTORS = [
    ('"null"', '"null"', 7195948357588979594),
    ('"boolean"', '"boolean"', -6970731678124411036),
    ('{"type": "int"}', '"int"', 8247732601305521295),
    ('"long"', '"long"', -3434872931120570953),
    ('"double"', '"double"', -8181574048448539266),
    ('"bytes"', '"bytes"', 5746618253357095269),
    ('{"fields":[], "type":"record", "name":"foo"}', '{"name":"foo","type":"record","fields":[]}',
     -4824392279771201922),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "canonical", "expected"), VECTORS)
def test_fingerprint_matches_the_avro_test_vectors(
    schema: str, canonical: str, expected: int
) -> None:
    parsed = json.loads(schema)
    assert canonical_form(parsed) == canonical
    assert as_signed(reference_fingerprint64(canonical.encode())) == expected
    assert fingerprint(parsed) == (expected % (1 << 64)).to_bytes(8, "little")


def test_int_fingerprint_bytes() -> None:
    # 8247732601305521295 == 0x7275D51A3F395C8F, written little-endian.
    assert fingerprint("int") == bytes.fromhex("8f5c393f1ad57572")


def test_canonical_form_agrees_with_apache_avro() -> None:
    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner
        again: list[Inner]
        maybe: str | None = None

    schema = event_schema(Outer, event_type="a.b")
    apache = avro.schema.parse(json.dumps(schema))
    assert canonical_form(schema) == apache.canonical_form
    assert fingerprint(schema) == apache.fingerprint("CRC-64-AVRO")


def test_logical_types_do_not_change_the_fingerprint() -> None:
    plain = {"type": "record", "name": "r", "fields": [{"name": "a", "type": "string"}]}
    uuid = {"type": "record", "name": "r", "fields": [
        {"name": "a", "type": {"type": "string", "logicalType": "uuid"}, "doc": "x"}]}  # fmt: skip
    assert fingerprint(plain) == fingerprint(uuid)


def test_single_object_header_for_int() -> None:
    # The Avro specification's example layout: C3 01, fingerprint (LE), body.
    value = single_object.frame(fingerprint("int"), b"\x02")
    assert value == bytes.fromhex("c3018f5c393f1ad5757202")
    assert single_object.unframe(value) == (fingerprint("int"), b"\x02")


class Tiny(BaseModel):
    id: int


def test_encoded_event_starts_with_its_header() -> None:
    registry = Registry()
    event_type = registry.register(Tiny, name="tiny.made", key="id", aggregate="tiny")
    value, headers = Codec(registry=registry).encode(Tiny(id=1))
    assert value[:2] == b"\xc3\x01"
    assert value[2:10] == event_type.fingerprint
    assert value[10:] == b"\x02"  # zig-zag varint of 1
    assert headers == {"content-type": "application/vnd.oncely.avro", "schema-version": "1"}


def test_confluent_framing_is_magic_byte_then_big_endian_schema_id() -> None:
    registry = Registry()
    registry.register(Tiny, name="tiny.made", key="id", aggregate="tiny", encoding="avro-confluent")
    client = SchemaRegistryClient.new_client({"url": "mock://wire-format"})
    codec = Codec(registry=registry, schema_registry=client, auto_register=True)
    value, headers = codec.encode(Tiny(id=1))
    registered = client.get_latest_version("tiny.made-value")
    assert registered.schema_id is not None
    assert value[0] == 0
    assert value[1:5] == registered.schema_id.to_bytes(4, "big")
    assert schema_id(value) == registered.schema_id
    assert value[5:] == b"\x02"
    assert headers["content-type"] == "application/vnd.confluent.avro"


@pytest.mark.parametrize(
    ("value", "cause"),
    [(b"\x00\x00\x00", "too short"), (b"\x01\x00\x00\x00\x01\x02", "not the Confluent magic")],
)
def test_confluent_framing_errors(value: bytes, cause: str) -> None:
    with pytest.raises(DecodeError, match=cause) as caught:
        schema_id(value)
    assert caught.value.reason is DecodeFailure.CORRUPT


def test_dump_avsc_is_sorted_indented_and_newline_terminated() -> None:
    text = dump_avsc({"type": "record", "name": "é", "fields": []})
    assert text == '{\n  "fields": [],\n  "name": "é",\n  "type": "record"\n}\n'
