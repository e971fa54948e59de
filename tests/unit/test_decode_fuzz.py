"""Fuzz the consumer's decode path: arbitrary bytes and headers never crash it, nor hang it.

``read_envelope`` then ``decode_event`` must return ``Decoded`` or ``Undecodable`` and
``Codec.decode`` must return an event or raise ``DecodeError``: any other exception would escape
the consumer loop, and a hang would stall a partition. Values are drawn from several families, so
the Avro body reader and the model validation are reached, not only the framing checks: raw
bytes, valid values truncated, bit-flipped or extended, a known fingerprint with a random body,
another type's fingerprint, Confluent framing, and JSON.

This module runs a short campaign (``make test``); ``tests/chaos/test_decode_fuzz_long.py``
runs the same property for ``ONCELY_FUZZ_EXAMPLES`` (default 100,000) cases (``make chaos``).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID, uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import AwareDatetime, BaseModel, Field

from oncely.consumers.records import Decoded, Undecodable, decode_event, read_envelope
from oncely.events import Registry
from oncely.schemas import single_object
from oncely.schemas.codec import Codec
from oncely.schemas.errors import DecodeError

SHORT_RUN = 2_000


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Line(BaseModel):
    sku: str
    quantity: int
    price: Annotated[Decimal, Field(max_digits=12, decimal_places=2)]


class OrderPlaced(BaseModel):
    order_id: UUID
    customer: str
    total: int
    ratio: float
    paid: bool
    blob: bytes
    at: AwareDatetime
    due: date
    colour: Colour
    lines: list[Line]
    tags: dict[str, int]
    note: str | None = None


class Pinged(BaseModel):
    host: str
    n: int


class Noted(BaseModel):
    note_id: str
    text: str
    when: datetime


registry = Registry(topic_prefix="fuzz.")
registry.register(OrderPlaced, name="order.placed", key="order_id", aggregate="order")
registry.register(Pinged, name="ping", key="host", aggregate="host")
registry.register(Noted, name="noted", key="note_id", aggregate="note", encoding="json")
codec = Codec(registry=registry)
TYPES = {t.topic: t for t in registry}
ORDER, PING, NOTED = (registry.get(n) for n in ("order.placed", "ping", "noted"))


def _order(rng: random.Random) -> OrderPlaced:
    return OrderPlaced(
        order_id=uuid4(),
        customer="c" * rng.randrange(0, 40),
        total=rng.randrange(-(2**62), 2**62),
        ratio=rng.random(),
        paid=rng.random() < 0.5,
        blob=rng.randbytes(rng.randrange(0, 20)),
        at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randrange(10**6)),
        due=date(2026, 1, 1) + timedelta(days=rng.randrange(1000)),
        colour=rng.choice(list(Colour)),
        lines=[
            Line(sku=f"s{i}", quantity=i, price=Decimal(rng.randrange(10**6)) / 100)
            for i in range(rng.randrange(0, 4))
        ],
        tags={f"t{i}": i for i in range(rng.randrange(0, 3))},
        note=None if rng.random() < 0.5 else "n",
    )


_VALID = [codec.encode(_order(random.Random(seed)))[0] for seed in range(8)]
_VALID += [codec.encode(Pinged(host="h", n=seed))[0] for seed in range(3)]
_VALID += [codec.encode(Noted(note_id="x", text="t", when=datetime.now(UTC)))[0]]
_FINGERPRINTS = [t.fingerprint for t in registry if t.encoding == "avro"]


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """A valid value, then truncated, bit-flipped, spliced or extended."""
    value = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(0, 4))):
        action = draw(st.sampled_from(["truncate", "flip", "insert", "append", "splice"]))
        position = draw(st.integers(0, max(0, len(value) - 1)))
        if action == "truncate":
            del value[position:]
        elif action == "flip" and value:
            value[position] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            value[position:position] = draw(st.binary(max_size=9))
        elif action == "append":
            value += draw(st.binary(max_size=64))
        else:
            value[position:] = draw(st.sampled_from(_VALID))[position:]
    return bytes(value)


VALUES = st.one_of(
    st.binary(max_size=256),
    _mutated(),
    st.builds(
        lambda fp, body: single_object.frame(fp, body),
        st.sampled_from(_FINGERPRINTS) | st.binary(min_size=8, max_size=8),
        st.binary(max_size=256),
    ),
    st.builds(lambda body: b"\x00" + body, st.binary(max_size=64)),  # Confluent framing
    st.builds(lambda text: text.encode(), st.text(max_size=64)),
    st.sampled_from(
        [
            b'{"note_id": "x", "text": "t", "when": "2026-01-01T00:00:00Z"}',
            b'{"note_id": 1e999999, "text": [], "when": null}',
            b"[" * 5000,
            b'{"a":' * 3000,
        ]
    ),
)
HEADER_VALUES = st.one_of(
    st.none(),
    st.binary(max_size=40),
    st.sampled_from([str(uuid4()).encode(), b"order.placed", b"ping", b"noted"]),
    st.sampled_from([b"application/vnd.oncely.avro", b"application/json", b"\xff\xfe", b"1"]),
)
HEADER_NAMES = st.one_of(
    st.sampled_from(["id", "eventType", "content-type", "schema-version", "traceparent"]),
    st.text(max_size=12),
)
RANDOM_HEADERS = st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=8)
# Mostly the headers the relay writes, so that most cases reach the codec's body reader.
RELAY_HEADERS = st.builds(
    lambda kind, content, extra: [
        *([("eventType", kind)] if kind is not None else []),
        *([("content-type", content)] if content is not None else []),
        *extra,
    ],
    st.none() | st.sampled_from([b"order.placed", b"ping", b"noted"]),
    st.none() | st.sampled_from([b"application/vnd.oncely.avro", b"application/json"]),
    st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=1),
)
HEADERS = st.one_of(RELAY_HEADERS, RELAY_HEADERS, RANDOM_HEADERS)


@dataclass
class FakeMessage:
    """What ``read_envelope`` and ``decode_event`` read of a confluent-kafka ``Message``."""

    _topic: str
    _value: bytes | None
    _headers: list[tuple[str, bytes | None]] | None
    _key: bytes | None = field(default=b"k")

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 0

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self._headers


def decode_record(message: Any, *, codec: Any, types_by_topic: Any) -> Decoded | Undecodable:
    """What a consumer makes of a new record: its envelope, then its value."""
    envelope = read_envelope(message, types_by_topic=types_by_topic)
    if isinstance(envelope, Undecodable):
        return envelope
    return decode_event(envelope, codec=codec)


def check_decode(topic: str, value: bytes | None, headers: list[tuple[str, Any]], add_id: bool):
    """The property: one record through both entry points."""
    if add_id:
        headers = [("id", str(uuid4()).encode()), *headers]
    message: Any = FakeMessage(topic, value, headers)
    result = decode_record(message, codec=codec, types_by_topic=TYPES)
    assert isinstance(result, Decoded | Undecodable)
    if isinstance(result, Undecodable):
        assert result.reason
    if value is not None:
        model = TYPES.get(topic, ORDER).model
        for given_headers, expected in [(headers, model), (headers, None), (None, model)]:
            try:
                event = codec.decode(value, given_headers, expected=expected)
            except DecodeError:
                continue  # the one exception allowed
            assert isinstance(event, BaseModel)


TOPICS = st.sampled_from([ORDER.topic, ORDER.topic, PING.topic, NOTED.topic, "fuzz.unknown"])


def run_campaign(max_examples: int) -> None:
    """Run the property for ``max_examples`` cases (each bounded by hypothesis's deadline)."""

    @settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=2),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(TOPICS, VALUES | st.none(), HEADERS, st.booleans() | st.just(True))
    def prop(topic: str, value: bytes | None, headers: list[tuple[str, Any]], add_id: bool) -> None:
        check_decode(topic, value, headers, add_id)

    prop()


@pytest.mark.slow  # thousands of generated records
def test_decode_never_raises_anything_but_decode_error() -> None:
    run_campaign(SHORT_RUN)


def test_valid_values_still_decode() -> None:
    # The generators' seeds are real events: the property is not vacuous.
    for value in _VALID[:8]:
        headers = [("id", str(uuid4()).encode()), ("eventType", b"order.placed")]
        result = decode_record(
            FakeMessage(ORDER.topic, value, headers),  # type: ignore[arg-type]
            codec=codec,
            types_by_topic=TYPES,
        )
        assert isinstance(result, Decoded), result


def test_hostile_header_shapes_are_undecodable() -> None:
    huge = [("id", str(uuid4()).encode()), ("x", b"a" * (64 * 1024 + 1))]
    many = [("id", str(uuid4()).encode())] + [(f"h{i}", b"v") for i in range(1001)]
    bulky = [("id", str(uuid4()).encode())] + [(f"h{i}", b"v" * 60_000) for i in range(20)]
    for headers, reason in [(huge, "bytes long"), (many, "1002 headers"), (bulky, "in all")]:
        result = decode_record(
            FakeMessage(ORDER.topic, _VALID[0], headers),  # type: ignore[arg-type]
            codec=codec,
            types_by_topic=TYPES,
        )
        assert isinstance(result, Undecodable) and reason in result.reason, result
