"""An application's events as an AsyncAPI 3.0 document, for the teams that consume them.

:func:`asyncapi_document` describes what the code declares, nothing from the environment (no
broker address, no partition counts), so the document of a commit is always the same:

- ``channels``: one per topic (its id and ``address`` are the topic), holding the messages of
  the event types on it;
- ``components.messages``: one per event type (its id is the type's name): the payload schema,
  the record's headers (:mod:`oncely.wire`) and, in the Kafka message binding, the key;
- the payload: the type's Avro schema as a multi-format schema
  (``application/vnd.apache.avro;version=1.9.0``) for the ``avro`` and ``avro-confluent``
  encodings, or the JSON Schema of its pydantic model (field names, as the codec writes them;
  nested definitions in ``components.schemas``) for ``json``;
- ``operations``: ``send.<event type>`` for each type (the relay publishes what the
  application stages) and ``receive.<effect>.<event type>`` for each effect and type it
  consumes, with the effect's consumer group as the Kafka operation binding's ``groupId``.

The payload is the code's version of each schema; values written with older versions stay on
the topics (the ``schema-version`` header tells), and the committed catalog holds their schemas.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from uuid import UUID

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from oncely.errors import ConfigurationError
from oncely.events import EventType, Registry
from oncely.schemas.codec import CONTENT_TYPES
from oncely.wire import (
    CLOUDEVENTS_HEADERS,
    CLOUDEVENTS_SPECVERSION,
    CONTENT_TYPE_HEADER,
    EVENT_TYPE_HEADER,
    ID_HEADER,
    SCHEMA_VERSION_HEADER,
)

if TYPE_CHECKING:
    from oncely.consumers.effects import Effect, Effects

__all__ = ["ASYNCAPI_VERSION", "AsyncApiError", "asyncapi_document", "render"]

ASYNCAPI_VERSION = "3.0.0"
#: The Kafka bindings version whose fields the document uses (``groupId``, ``key``, ...).
KAFKA_BINDING_VERSION = "0.5.0"
AVRO_SCHEMA_FORMAT = "application/vnd.apache.avro;version=1.9.0"
_SCHEMAS_REF = "#/components/schemas/{model}"

_ENCODING_TEXT = {
    "avro": (
        "Avro single-object encoding: the bytes C3 01, the 8-byte little-endian CRC-64-AVRO "
        "fingerprint of the writer schema, then the Avro binary body. The writer schema of "
        "every version is in the application's committed schema catalog "
        "(<event type>/v<N>.avsc); the payload here is version {version}."
    ),
    "avro-confluent": (
        "Confluent wire format: the byte 00, the writer schema's 4-byte big-endian id in the "
        "schema registry (subject <topic>-value), then the Avro binary body. The payload here "
        "is version {version}."
    ),
    "json": (
        "UTF-8 JSON of the event's fields (field names, not aliases). The payload here is "
        "version {version}."
    ),
}


class AsyncApiError(ConfigurationError):
    """The application's declarations cannot be written as an AsyncAPI document."""


def asyncapi_document(
    *,
    registry: Registry,
    effects: Effects | None = None,
    title: str,
    version: str,
) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``registry``'s event types and ``effects``' consumers.

    ``title`` and ``version`` are the document's ``info`` (the API's name and version, not an
    event type's). The result is plain JSON data, the same for the same declarations.

    Raises:
        AsyncApiError: two effects' operations would get the same id (effect ``a.b`` on type
            ``c`` and effect ``a`` on type ``b.c``); rename one effect.
    """
    event_types = list(registry)
    json_models, schemas = _json_schemas(t for t in event_types if t.encoding == "json")
    by_topic: dict[str, list[EventType[Any]]] = {}
    for event_type in event_types:
        by_topic.setdefault(event_type.topic, []).append(event_type)
    operations: dict[str, Any] = {f"send.{t.name}": _send_operation(t) for t in event_types}
    if effects is not None:
        _add_receive_operations(operations, effects)
    components: dict[str, Any] = {
        "messages": {t.name: _message(t, json_models.get(t.model)) for t in event_types}
    }
    if schemas:
        components["schemas"] = schemas
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {"title": title, "version": version},
        "defaultContentType": CONTENT_TYPES["avro"],  # the registry's default encoding
        "channels": {topic: _channel(topic, types) for topic, types in by_topic.items()},
        "operations": operations,
        "components": components,
    }


def render(document: dict[str, Any]) -> str:
    """``document`` as the JSON text to write: indented, UTF-8 characters kept, newline-ended."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def _channel(topic: str, event_types: list[EventType[Any]]) -> dict[str, Any]:
    names = ", ".join(t.name for t in event_types)
    return {
        "address": topic,
        "description": f"The Kafka topic of {names} events, keyed by aggregate id (each "
        "key's events in commit order).",
        "messages": {t.name: {"$ref": f"#/components/messages/{t.name}"} for t in event_types},
    }


def _message_ref(event_type: EventType[Any]) -> dict[str, str]:
    return {"$ref": f"#/channels/{event_type.topic}/messages/{event_type.name}"}


def _send_operation(event_type: EventType[Any]) -> dict[str, Any]:
    return {
        "action": "send",
        "channel": {"$ref": f"#/channels/{event_type.topic}"},
        "messages": [_message_ref(event_type)],
        "summary": f"Publish {event_type.name} events.",
        "description": "The application stages each event in the transaction of its business "
        "change (oncely.stage); after the commit the outbox relay publishes it, at least "
        "once, with its event id in the id header.",
    }


def _add_receive_operations(operations: dict[str, Any], effects: Effects) -> None:
    for effect in effects:
        group_id = effects.group_id(effect.name)
        for event_type in effect.event_types:
            key = f"receive.{effect.name}.{event_type.name}"
            if key in operations:
                raise AsyncApiError(
                    f"effect {effect.name!r} and another effect both give the AsyncAPI "
                    f"operation id {key!r}; rename one of them"
                )
            operations[key] = _receive_operation(effect, event_type, group_id)


def _receive_operation(effect: Effect, event_type: EventType[Any], group_id: str) -> dict[str, Any]:
    if effect.failure.then == "dead_letter":
        failing = (
            f"after {effect.failure.max_attempts} attempts it goes to the dead-letter topic "
            f"{effect.dlq_topic(event_type.topic)}"
        )
    else:
        failing = f"after {effect.failure.max_attempts} attempts it stops the partition"
    return {
        "action": "receive",
        "channel": {"$ref": f"#/channels/{event_type.topic}"},
        "messages": [_message_ref(event_type)],
        "summary": f"The effect {effect.name}, applied once per {event_type.name} event.",
        "description": f"Consumer group {group_id}: each event is applied once, with a "
        f"receipt of its id; an event that keeps failing is retried and {failing}.",
        "bindings": {
            "kafka": {
                "groupId": {"type": "string", "enum": [group_id]},
                "bindingVersion": KAFKA_BINDING_VERSION,
            }
        },
    }


def _message(event_type: EventType[Any], json_payload: dict[str, Any] | None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "name": event_type.name,
        "title": event_type.model.__name__,
    }
    doc = event_type.schema.get("doc")
    if isinstance(doc, str):
        message["summary"] = doc.splitlines()[0]
    message["description"] = (
        f"A {event_type.aggregate} event, version {event_type.version}. "
        + _ENCODING_TEXT[event_type.encoding].format(version=event_type.version)
    )
    message["contentType"] = CONTENT_TYPES[event_type.encoding]
    message["headers"] = _headers(event_type)
    if json_payload is not None:
        message["payload"] = json_payload
    else:
        message["payload"] = {"schemaFormat": AVRO_SCHEMA_FORMAT, "schema": event_type.schema}
    message["bindings"] = {"kafka": _kafka_message_binding(event_type)}
    return message


def _headers(event_type: EventType[Any]) -> dict[str, Any]:
    """The record's headers (:mod:`oncely.wire`); Debezium's router sets only the first two."""
    return {
        "type": "object",
        "properties": {
            ID_HEADER: {
                "type": "string",
                "format": "uuid",
                "description": "The event id (a UUIDv7, 36 lowercase characters); a "
                "redelivered or republished event keeps it.",
            },
            EVENT_TYPE_HEADER: {
                "type": "string",
                "const": event_type.name,
                "description": "The event type.",
            },
            CONTENT_TYPE_HEADER: {
                "type": "string",
                "const": CONTENT_TYPES[event_type.encoding],
                "description": "The value's encoding (set by oncely's relay, not by Debezium's "
                "outbox router).",
            },
            SCHEMA_VERSION_HEADER: {
                "type": "string",
                "pattern": "^[1-9][0-9]*$",
                "description": "The version of the schema the value was written with (set by "
                "oncely's relay, not by Debezium's outbox router).",
            },
            "traceparent": {
                "type": "string",
                "description": "The W3C trace context: of the relay's span when it traces, else "
                "of the span that staged the event (absent when none was active).",
            },
            "tracestate": {"type": "string", "description": "W3C trace context, with traceparent."},
            "baggage": {"type": "string", "description": "W3C baggage of the staging context."},
            **{
                name: {"type": "string", "description": description}
                for name, description in _CLOUDEVENTS.items()
            },
        },
        "required": [ID_HEADER, EVENT_TYPE_HEADER],
    }


#: The CloudEvents binary-mode headers (:func:`oncely.wire.cloudevents_headers`).
_CLOUDEVENTS = dict(
    zip(
        CLOUDEVENTS_HEADERS,
        [
            "CloudEvents id: the event id (when ONCELY_RELAY_CLOUDEVENTS_SOURCE is set).",
            "CloudEvents type: the event type.",
            "CloudEvents time: when the event was staged (RFC 3339, UTC, microseconds).",
            "CloudEvents source: the deployment's ONCELY_RELAY_CLOUDEVENTS_SOURCE.",
            f"CloudEvents specversion: {CLOUDEVENTS_SPECVERSION}.",
        ],
        strict=True,
    )
)


def _kafka_message_binding(event_type: EventType[Any]) -> dict[str, Any]:
    key: dict[str, Any] = {
        "type": "string",
        "description": f"The {event_type.aggregate} id: the event's {event_type.key} field "
        "as UTF-8 text (the outbox row's aggregateid).",
    }
    annotation = event_type.model.model_fields[event_type.key].annotation
    if annotation is UUID:
        key["format"] = "uuid"
    elif annotation is int:
        key["pattern"] = "^-?[0-9]+$"
    binding: dict[str, Any] = {"key": key}
    if event_type.encoding == "avro-confluent":
        binding["schemaIdLocation"] = "payload"
        binding["schemaIdPayloadEncoding"] = "confluent"
        binding["schemaLookupStrategy"] = "TopicNameStrategy"
    binding["bindingVersion"] = KAFKA_BINDING_VERSION
    return binding


def _json_schemas(
    event_types: Iterable[EventType[Any]],
) -> tuple[dict[type[BaseModel], dict[str, Any]], dict[str, Any]]:
    """Each JSON-encoded type's payload schema (a reference into ``components.schemas``) and
    those schemas (its model's and the models and enums it nests, named uniquely)."""
    models = [t.model for t in event_types]
    if not models:
        return {}, {}
    references, definitions = models_json_schema(
        [(model, "serialization") for model in models],
        by_alias=False,
        ref_template=_SCHEMAS_REF,
    )
    payloads = {model: dict(references[(model, "serialization")]) for model in models}
    return payloads, dict(definitions.get("$defs", {}))
