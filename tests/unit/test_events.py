"""The event registry: one topic per type, keys, and errors that name the offender."""

from __future__ import annotations

import warnings
from decimal import Decimal
from uuid import UUID, uuid4

import pytest
from pydantic import BaseModel

from oncely.errors import ConfigurationError
from oncely.events import (
    DuplicateEventTypeError,
    DuplicateTopicError,
    EventDeclarationError,
    InvalidTopicNameError,
    Registry,
    RegistryError,
    TopicNameWarning,
    UnknownEventTypeError,
    validate_topic_name,
)
from oncely.events.avro import SchemaDerivationError


class Added(BaseModel):
    download_id: UUID
    title: str


class Removed(BaseModel):
    download_id: UUID


def test_declared_type_gets_prefixed_topic_key_and_schema() -> None:
    registry = Registry(topic_prefix="media.")

    @registry.event("download.added", key="download_id", aggregate="download", version=3)
    class DownloadAdded(Added):
        pass

    event_type = registry.get("download.added")
    assert event_type.topic == "media.download.added"
    assert event_type.model is DownloadAdded
    assert event_type.aggregate == "download"
    assert event_type.version == 3
    assert event_type.encoding == "avro"
    assert event_type.schema["name"] == "DownloadAdded"
    assert len(event_type.fingerprint) == 8
    assert registry.for_model(DownloadAdded) is event_type
    assert registry.topic_for("download.added") == "media.download.added"
    assert "download.added" in registry
    assert list(registry) == [event_type]
    assert len(registry) == 1


def test_decorator_returns_the_class_unchanged() -> None:
    registry = Registry()
    decorated = registry.event("x.y", key="download_id", aggregate="x")(Added)
    assert decorated is Added


def test_topic_override_and_encoding() -> None:
    registry = Registry(topic_prefix="ignored.")
    event_type = registry.register(
        Added, name="download.added", key="download_id", aggregate="download",
        topic="downloads", encoding="json",
    )  # fmt: skip
    assert event_type.topic == "downloads"
    assert event_type.encoding == "json"


def test_key_of_gives_the_kafka_key() -> None:
    registry = Registry()
    event_type = registry.register(Added, name="download.added", key="download_id", aggregate="d")
    download_id = uuid4()
    assert event_type.key_of(Added(download_id=download_id, title="t")) == str(download_id)


def test_unknown_event_type_is_named() -> None:
    registry = Registry()
    with pytest.raises(UnknownEventTypeError) as caught:
        registry.get("x.y")
    assert "no durable topic registered for event type 'x.y'" in str(caught.value)
    with pytest.raises(UnknownEventTypeError, match=r"'x.y'"):
        registry.topic_for("x.y")
    assert isinstance(caught.value, ConfigurationError)


def test_unknown_model_is_named() -> None:
    with pytest.raises(UnknownEventTypeError, match=r"event model Added"):
        Registry().for_model(Added)


@pytest.mark.parametrize(
    ("model", "name", "topic", "error", "message"),
    [
        (Removed, "a.b", None, DuplicateEventTypeError, r"'a.b' is already registered"),
        (Added, "a.c", None, DuplicateEventTypeError, r"Added is already registered"),
        (
            Removed,
            "a.c",
            "a.b",
            DuplicateTopicError,
            r"'a.b' of event type 'a.c'.*topic of event type 'a.b'",
        ),
        (Removed, "a_b", None, DuplicateTopicError, r"'a_b'.*collides with 'a.b'"),
    ],
    ids=["type-name", "one-model-one-type", "topic-naming-both-owners", "metric-name-collision"],
)
def test_a_declaration_clashing_with_a_registered_one_is_rejected(
    model: type[BaseModel],
    name: str,
    topic: str | None,
    error: type[RegistryError],
    message: str,
) -> None:
    registry = Registry()
    registry.register(Added, name="a.b", key="download_id", aggregate="d")
    with pytest.raises(error, match=message):
        registry.register(model, name=name, key="download_id", aggregate="d", topic=topic)


def test_failed_declaration_leaves_the_registry_unchanged() -> None:
    registry = Registry()
    registry.register(Added, name="a", key="download_id", aggregate="d")
    with pytest.raises(DuplicateTopicError):
        registry.register(Removed, name="b", key="download_id", aggregate="d", topic="a")
    registry.register(Removed, name="b", key="download_id", aggregate="d")
    assert registry.topics() == ["a", "b"]


@pytest.mark.parametrize(
    ("topic", "reason"),
    [
        ("", "not allowed"),
        (".", "not allowed"),
        ("..", "not allowed"),
        ("a" * 250, "250 characters long"),
        ("payments/transfer", "contains '/'"),
        ("trans fer", "contains ' '"),
        ("tränsfer", "contains 'ä'"),
    ],
)
def test_illegal_topic_names_are_rejected(topic: str, reason: str) -> None:
    with pytest.raises(InvalidTopicNameError, match=reason):
        validate_topic_name(topic)


@pytest.mark.parametrize("topic", ["a" * 249, "payments.transfer-completed", "A_b-9", "...."])
def test_legal_topic_names_pass(topic: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_topic_name(topic)


def test_mixing_dot_and_underscore_warns() -> None:
    registry = Registry()
    with pytest.warns(TopicNameWarning, match=r"'pay_ments.done' mixes '.' and '_'"):
        registry.register(Added, name="pay_ments.done", key="download_id", aggregate="d")


def test_illegal_override_topic_is_named() -> None:
    with pytest.raises(InvalidTopicNameError, match=r"'bad topic'"):
        Registry().register(Added, name="a", key="download_id", aggregate="d", topic="bad topic")


def test_missing_key_field_names_field_and_model() -> None:
    with pytest.raises(EventDeclarationError, match=r"key field 'id' is missing from model Added"):
        Registry().register(Added, name="a", key="id", aggregate="d")


class Nested(BaseModel):
    key: Removed


class OptionalKey(BaseModel):
    key: int | None = None


class StrKey(BaseModel):
    key: str


@pytest.mark.parametrize("model", [Nested, OptionalKey])
def test_key_field_must_be_a_scalar(model: type[BaseModel]) -> None:
    with pytest.raises(EventDeclarationError, match=r"key field \w+\.key is"):
        Registry().register(model, name="a", key="key", aggregate="d")


def test_str_key_is_accepted() -> None:
    event_type = Registry().register(StrKey, name="a", key="key", aggregate="d")
    assert event_type.key_of(StrKey(key="k-1")) == "k-1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "a..b"}, "event type name 'a..b'"),
        ({"name": "a/b"}, "event type name 'a/b'"),
        ({"version": 0}, "version must be an integer >= 1"),
        ({"version": True}, "version must be an integer >= 1"),
        ({"aggregate": ""}, "aggregate must not be empty"),
        ({"encoding": "protobuf"}, "encoding 'protobuf' is not one of"),
    ],
)
def test_invalid_declarations_are_named(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"name": "a", "key": "download_id", "aggregate": "d"} | kwargs
    with pytest.raises(EventDeclarationError, match=message):
        Registry().register(Added, **arguments)  # type: ignore[arg-type]


def test_non_model_is_rejected() -> None:
    with pytest.raises(EventDeclarationError, match=r"not a pydantic BaseModel"):
        Registry().register(dict, name="a", key="k", aggregate="d")  # type: ignore[type-var]


def test_model_without_avro_mapping_fails_at_declaration() -> None:
    class Bare(BaseModel):
        id: int
        amount: Decimal

    with pytest.raises(SchemaDerivationError, match=r"Bare\.amount: a Decimal needs"):
        Registry().register(Bare, name="a", key="id", aggregate="d")


def test_every_registry_error_is_a_configuration_error() -> None:
    assert issubclass(RegistryError, ConfigurationError)
    for error in (UnknownEventTypeError, DuplicateTopicError, InvalidTopicNameError):
        assert issubclass(error, RegistryError)
