"""``oncely asyncapi``: the document is valid AsyncAPI 3.0.0 (the official JSON Schema, in
tests/data/asyncapi), describes the records the code really writes, and the committed copy of
the example app's document is current."""

from __future__ import annotations

import copy
import difflib
import io
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from examples.payments.app import app as payments
from examples.payments.events import TransferCompleted
from fastavro import parse_schema, schemaless_reader
from jsonschema import Draft7Validator
from jsonschema.exceptions import best_match
from pydantic import BaseModel, Field
from referencing import Registry as SchemaRegistry
from referencing import Resource
from referencing.exceptions import NoSuchResource
from referencing.jsonschema import DRAFT7

import oncely
from oncely.cli import app as cli
from oncely.cli._errors import run
from oncely.ops.asyncapi import AVRO_SCHEMA_FORMAT, AsyncApiError, asyncapi_document, render
from oncely.schemas import single_object
from oncely.schemas.codec import Codec
from oncely.wire import CLOUDEVENTS_HEADERS, record_headers

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL_SCHEMA = ROOT / "tests" / "data" / "asyncapi" / "asyncapi-3.0.0.schema.json"
COMMITTED = "docs/asyncapi/payments.json"
#: How the committed document is made (`make lint` runs it with --check).
GENERATE = [
    "asyncapi",
    "--app",
    "examples.payments.app:app",
    "--title",
    "oncely payments example",
    "--output",
]


def _offline(uri: str) -> Resource:
    raise NoSuchResource(ref=uri)


@pytest.fixture(scope="module")
def asyncapi_validator() -> Draft7Validator:
    """The official schema's validator; a reference it cannot resolve in itself fails (no
    network: retrieval refuses every URI)."""
    schema = json.loads(OFFICIAL_SCHEMA.read_text(encoding="utf-8"))
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema"
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema, registry=SchemaRegistry(retrieve=_offline))


def _problems(validator: Draft7Validator, document: dict[str, Any]) -> str | None:
    error = best_match(validator.iter_errors(document))
    if error is None:
        return None
    return f"at {'/'.join(map(str, error.absolute_path))}: {error.message[:500]}"


def _payments_document() -> dict[str, Any]:
    return asyncapi_document(
        registry=payments.require_registry("payments"),
        effects=payments.effects,
        title="payments",
        version="1.0.0",
    )


# -- a second application: every encoding, a nested JSON model, an effect on two types --------

shop = oncely.Registry(topic_prefix="shop.")


class Size(StrEnum):
    SMALL = "s"
    LARGE = "l"


class Line(BaseModel):
    sku: str
    size: Size


@shop.event("order.placed", key="order_id", aggregate="order", encoding="json")
class OrderPlaced(BaseModel):
    """An order was placed.

    More about it."""

    order_id: UUID
    lines: list[Line]
    note: str | None = Field(default=None, alias="Note")


@shop.event("order.shipped", key="order_no", aggregate="order", encoding="avro-confluent")
class OrderShipped(BaseModel):
    order_no: int


@shop.event("order.paid", key="order_id", aggregate="order", version=3)
class OrderPaid(BaseModel):
    order_id: str
    amount: Decimal = Field(max_digits=10, decimal_places=2)


shop_effects = oncely.Effects(shop, group_prefix="shop-")


@shop_effects.effect("notify", on=[OrderPlaced, OrderShipped])
def _notify(event: BaseModel, ctx: oncely.EffectContext) -> None: ...


def _shop_document() -> dict[str, Any]:
    return asyncapi_document(registry=shop, effects=shop_effects, title="shop", version="2.1.0")


# -- validity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_payments_document, _shop_document], ids=["payments", "shop"])
def test_the_document_is_valid_asyncapi_3(
    make: Callable[[], dict[str, Any]], asyncapi_validator: Draft7Validator
) -> None:
    document = make()
    assert _problems(asyncapi_validator, document) is None, _problems(asyncapi_validator, document)
    assert json.loads(render(document)) == document


def _operation(document: dict[str, Any]) -> dict[str, Any]:
    return document["operations"]["receive.send-receipt.transfer.completed"]


def _message(document: dict[str, Any]) -> dict[str, Any]:
    return document["components"]["messages"]["transfer.failed"]


BREAKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "AsyncAPI 2's publish action": lambda d: _operation(d).update(action="publish"),
    "AsyncAPI 2's channel operations": lambda d: d["channels"]["payments.transfer.failed"].update(
        subscribe={"message": {}}
    ),
    "another spec version": lambda d: d.update(asyncapi="2.6.0"),
    "an unknown Kafka operation binding field": lambda d: _operation(d)["bindings"]["kafka"].update(
        groupID="x"
    ),
    "an unknown Kafka binding version": lambda d: _operation(d)["bindings"]["kafka"].update(
        bindingVersion="9.9.9"
    ),
    "an unknown message field": lambda d: _message(d).update(messageId="x"),
    "an unknown Kafka message binding field": lambda d: _message(d)["bindings"]["kafka"].update(
        keys={"type": "string"}
    ),
    "an Avro payload of no Avro type": lambda d: _message(d)["payload"]["schema"].update(
        type="struct"
    ),
    "an Avro field without a type": lambda d: _message(d)["payload"]["schema"]["fields"][0].pop(
        "type"
    ),
    "headers of no JSON Schema type": lambda d: _message(d)["headers"].update(type="dict"),
    "an info without a version": lambda d: d["info"].pop("version"),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_the_validator_rejects_a_broken_document(
    name: str, asyncapi_validator: Draft7Validator
) -> None:
    document = copy.deepcopy(_payments_document())
    BREAKS[name](document)
    assert _problems(asyncapi_validator, document) is not None, f"{name} was accepted"


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} leaves the document"
    node: Any = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


@pytest.mark.parametrize("make", [_payments_document, _shop_document], ids=["payments", "shop"])
def test_every_reference_resolves_and_operations_use_their_channels_messages(
    make: Callable[[], dict[str, Any]],
) -> None:
    """What the JSON Schema cannot check: references point at something in the document."""
    document = make()
    refs = list(_refs(document))
    assert refs
    for ref in refs:
        try:
            _resolve(document, ref)
        except KeyError:
            pytest.fail(f"{ref} does not resolve in the document")
    for name, operation in document["operations"].items():
        channel = _resolve(document, operation["channel"]["$ref"])
        for message in operation["messages"]:
            assert message["$ref"].startswith(operation["channel"]["$ref"] + "/messages/"), name
            assert _resolve(document, message["$ref"]) in channel["messages"].values()


# -- what it says --------------------------------------------------------------------------------


def test_channels_messages_and_operations_follow_the_declarations() -> None:
    document = _payments_document()
    registry = payments.require_registry("payments")
    assert document["asyncapi"] == "3.0.0"
    assert document["info"] == {"title": "payments", "version": "1.0.0"}
    assert sorted(document["channels"]) == registry.topics()
    for event_type in registry:
        channel = document["channels"][event_type.topic]
        assert channel["address"] == event_type.topic
        assert channel["messages"] == {
            event_type.name: {"$ref": f"#/components/messages/{event_type.name}"}
        }
        message = document["components"]["messages"][event_type.name]
        assert message["name"] == event_type.name
        assert message["contentType"] == "application/vnd.oncely.avro"
        assert message["payload"] == {
            "schemaFormat": AVRO_SCHEMA_FORMAT,
            "schema": event_type.schema,
        }
        send = document["operations"][f"send.{event_type.name}"]
        assert send["action"] == "send"
        assert send["channel"] == {"$ref": f"#/channels/{event_type.topic}"}
    receives = {k: v for k, v in document["operations"].items() if v["action"] == "receive"}
    assert sorted(receives) == [
        "receive.ledger-projection.transfer.completed",
        "receive.send-receipt.transfer.completed",
    ]
    for effect in ("send-receipt", "ledger-projection"):
        operation = receives[f"receive.{effect}.transfer.completed"]
        assert operation["channel"] == {"$ref": "#/channels/payments.transfer.completed"}
        assert operation["bindings"]["kafka"]["groupId"] == {
            "type": "string",
            "enum": [f"payments.{effect}"],  # the group the consumer joins: group_prefix + name
        }
        assert f"payments.transfer.completed.{effect}.dlq" in operation["description"]
    assert "schemas" not in document["components"]  # no JSON-encoded type


def test_headers_and_key_are_the_records() -> None:
    document = _payments_document()
    message = document["components"]["messages"]["transfer.completed"]
    headers = message["headers"]
    assert headers["type"] == "object"
    assert headers["required"] == ["id", "eventType"]  # all Debezium's outbox router sets
    assert set(headers["properties"]) == {
        "id",
        "eventType",
        "content-type",
        "schema-version",
        "traceparent",
        "tracestate",
        "baggage",
        *CLOUDEVENTS_HEADERS,
    }
    assert headers["properties"]["eventType"]["const"] == "transfer.completed"
    assert headers["properties"]["content-type"]["const"] == "application/vnd.oncely.avro"
    assert message["bindings"]["kafka"]["key"]["type"] == "string"
    assert message["bindings"]["kafka"]["key"]["format"] == "uuid"
    assert "transfer_id" in message["bindings"]["kafka"]["key"]["description"]
    assert message["bindings"]["kafka"]["bindingVersion"] == "0.5.0"


def _record(codec: Codec, event: BaseModel) -> tuple[bytes, dict[str, str]]:
    """The value and headers of ``event``'s Kafka record, as the relay writes them."""
    value, headers = codec.encode(event)
    row_headers = tuple((name, text.encode()) for name, text in headers.items())
    name = codec.registry.for_model(type(event)).name
    record = record_headers(str(uuid4()), name, row_headers)
    return value, {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in record}


def test_an_avro_record_reads_with_the_documents_schema_and_headers() -> None:
    document = _payments_document()
    event = TransferCompleted(
        transfer_id=uuid4(),
        from_account="A-1",
        to_account="B-2",
        amount=Decimal("12.50"),
        currency="EUR",
        completed_at=datetime.now(UTC),
        fee=Decimal("0.10"),
    )
    value, headers = _record(Codec(registry=payments.require_registry("payments")), event)
    message = document["components"]["messages"]["transfer.completed"]
    _, body = single_object.unframe(value)
    datum = schemaless_reader(io.BytesIO(body), parse_schema(message["payload"]["schema"]), None)
    assert datum["transfer_id"] == event.transfer_id
    assert datum["fee"] == Decimal("0.10")
    assert Draft7Validator(message["headers"]).is_valid(headers)
    assert Draft7Validator(message["bindings"]["kafka"]["key"]).is_valid(str(event.transfer_id))


def test_json_and_avro_encodings_in_one_document() -> None:
    document = _shop_document()
    messages = document["components"]["messages"]
    placed, shipped, paid = (
        messages["order.placed"],
        messages["order.shipped"],
        messages["order.paid"],
    )
    assert placed["contentType"] == "application/json"
    assert placed["payload"] == {"$ref": "#/components/schemas/OrderPlaced"}
    assert placed["summary"] == "An order was placed."
    schemas = document["components"]["schemas"]
    assert sorted(schemas) == ["Line", "OrderPlaced", "Size"]  # the nested model and enum too
    assert set(schemas["OrderPlaced"]["properties"]) == {"order_id", "lines", "note"}  # no alias
    assert shipped["contentType"] == "application/vnd.confluent.avro"
    assert shipped["payload"]["schemaFormat"] == AVRO_SCHEMA_FORMAT
    assert shipped["bindings"]["kafka"]["schemaIdLocation"] == "payload"
    assert shipped["bindings"]["kafka"]["schemaIdPayloadEncoding"] == "confluent"
    assert shipped["bindings"]["kafka"]["key"]["pattern"] == "^-?[0-9]+$"  # an int key, as text
    assert paid["contentType"] == "application/vnd.oncely.avro"
    assert "version 3" in paid["description"]
    assert "format" not in paid["bindings"]["kafka"]["key"]  # a str key
    receives = sorted(k for k, v in document["operations"].items() if v["action"] == "receive")
    assert receives == ["receive.notify.order.placed", "receive.notify.order.shipped"]
    group = document["operations"]["receive.notify.order.shipped"]["bindings"]["kafka"]["groupId"]
    assert group["enum"] == ["shop-notify"]


def test_records_of_every_encoding_match_the_document() -> None:
    """The JSON value validates against the payload schema (with the document's references);
    the Confluent-framed and single-object values read with the document's Avro schemas."""
    document = _shop_document()
    messages = document["components"]["messages"]
    client = SchemaRegistryClient.new_client({"url": "mock://asyncapi"})
    codec = Codec(registry=shop, schema_registry=client, auto_register=True)

    placed = OrderPlaced(order_id=uuid4(), lines=[Line(sku="x", size=Size.LARGE)], Note="hi")
    value, headers = _record(codec, placed)
    uri = "urn:oncely:asyncapi-document"
    registry = SchemaRegistry().with_resource(uri, DRAFT7.create_resource(document))
    payload = Draft7Validator(
        {"$ref": f"{uri}#/components/messages/order.placed/payload"}, registry=registry
    )
    instance = json.loads(value)
    assert payload.is_valid(instance), best_match(payload.iter_errors(instance))
    assert not payload.is_valid({**instance, "lines": [{"sku": "x", "size": "xl"}]})
    assert Draft7Validator(messages["order.placed"]["headers"]).is_valid(headers)

    value, headers = _record(codec, OrderShipped(order_no=42))
    assert value[0] == 0  # Confluent's magic byte, then the 4-byte schema id
    schema = parse_schema(messages["order.shipped"]["payload"]["schema"])
    assert schemaless_reader(io.BytesIO(value[5:]), schema, None) == {"order_no": 42}
    assert Draft7Validator(messages["order.shipped"]["headers"]).is_valid(headers)
    assert Draft7Validator(messages["order.shipped"]["bindings"]["kafka"]["key"]).is_valid("42")

    value, headers = _record(codec, OrderPaid(order_id="o-1", amount=Decimal("3.20")))
    _, body = single_object.unframe(value)
    schema = parse_schema(messages["order.paid"]["payload"]["schema"])
    assert schemaless_reader(io.BytesIO(body), schema, None)["amount"] == Decimal("3.20")
    assert headers["schema-version"] == "3"
    assert Draft7Validator(messages["order.paid"]["headers"]).is_valid(headers)


def test_effects_whose_operation_ids_collide_are_refused() -> None:
    registry = oncely.Registry()

    @registry.event("c", key="k", aggregate="a")
    class C(BaseModel):
        k: str

    @registry.event("b.c", key="k", aggregate="a")
    class BC(BaseModel):
        k: str

    effects = oncely.Effects(registry)
    effects.effect("a.b", on=C)(lambda event, ctx: None)
    effects.effect("a", on=BC)(lambda event, ctx: None)
    with pytest.raises(AsyncApiError, match=r"operation id 'receive\.a\.b\.c'; rename one"):
        asyncapi_document(registry=registry, effects=effects, title="t", version="1")


def test_a_registry_alone_gives_only_send_operations() -> None:
    document = asyncapi_document(registry=shop, title="shop", version="1")
    assert {operation["action"] for operation in document["operations"].values()} == {"send"}


# -- the command and the committed document -------------------------------------------------------


def test_the_committed_example_document_is_current(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = tmp_path / "payments.json"
    assert run(cli, [*GENERATE, str(fresh)]) == 0
    committed = ROOT / COMMITTED
    current = committed.read_text(encoding="utf-8") if committed.exists() else ""
    generated = fresh.read_text(encoding="utf-8")
    if current != generated:
        diff = difflib.unified_diff(
            current.splitlines(), generated.splitlines(), "committed", "generated", lineterm=""
        )
        command = " ".join(f"'{a}'" if " " in a else a for a in GENERATE)
        pytest.fail(
            f"{COMMITTED} is stale: run `oncely {command} {COMMITTED}` from the repository root "
            "and commit it.\n\n" + "\n".join(list(diff)[:60]),
            pytrace=False,
        )
    assert run(cli, [*GENERATE, str(committed), "--check"]) == 0


def test_check_names_a_stale_or_missing_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "api.json"
    assert run(cli, [*GENERATE, str(target), "--check"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {target} is missing: run the same command without --check and commit the file"
    ]
    assert run(cli, [*GENERATE, str(target)]) == 0
    assert run(cli, [*GENERATE, str(target), "--check"]) == 0
    target.write_text(target.read_text(encoding="utf-8").replace("3.0.0", "2.6.0", 1))
    capsys.readouterr()
    assert run(cli, [*GENERATE, str(target), "--check"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {target} is stale")


def test_without_output_the_document_goes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(cli, ["asyncapi", "--app", "examples.payments.events:registry"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["info"] == {"title": "examples.payments.events", "version": "1.0.0"}
    assert {op["action"] for op in document["operations"].values()} == {"send"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--app", "no_such_module:app"], "cannot import module 'no_such_module'"),
        (["--app", "examples.payments.tasks:tasks"], "declares no event Registry"),
        (["--app", "examples.payments.app:app", "--check"], "--check"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(cli, ["asyncapi", *argv]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")
    assert expected in line
