"""The event registry: each durable event type's topic, key, aggregate, version and encoding."""

from __future__ import annotations

import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args, get_origin
from uuid import UUID

from pydantic import BaseModel

from oncely.errors import ConfigurationError
from oncely.events.avro import event_schema
from oncely.events.canonical import fingerprint

M = TypeVar("M", bound=BaseModel)

Encoding = Literal["avro", "avro-confluent", "json"]
"""How an event type's values are written: Avro single-object encoding (fingerprint of a
catalogued schema, no registry), Confluent wire format (schema registry id) or JSON."""
ENCODINGS: tuple[Encoding, ...] = ("avro", "avro-confluent", "json")
"""Every :data:`Encoding`, for checking a value read at run time."""

_TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")
_EVENT_TYPE_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_MAX_TOPIC_LENGTH = 249
_KEY_TYPES = (str, int, UUID)


class RegistryError(ConfigurationError):
    """The event registry was declared or queried wrongly."""


class UnknownEventTypeError(RegistryError):
    """No durable topic is registered for this event type."""


class DuplicateEventTypeError(RegistryError):
    """The event type (or its model class) is already registered."""


class DuplicateTopicError(RegistryError):
    """The topic already belongs to another event type."""


class InvalidTopicNameError(RegistryError):
    """The topic name is not a legal Kafka topic name."""


class EventDeclarationError(RegistryError):
    """The event type declaration is invalid."""


class TopicNameWarning(UserWarning):
    """The topic name mixes ``.`` and ``_``, which collide in Kafka's metric names."""


def validate_topic_name(topic: str) -> None:
    """Check that ``topic`` is a legal Kafka topic name.

    Legal: 1 to 249 characters of ``[a-zA-Z0-9._-]``, neither ``.`` nor ``..``. A name mixing
    ``.`` and ``_`` is legal but emits :class:`TopicNameWarning`, as Kafka's own tools warn.

    Raises:
        InvalidTopicNameError: naming the topic and the rule it breaks.
    """
    if topic in ("", ".", ".."):
        raise InvalidTopicNameError(f"topic name {topic!r} is not allowed by Kafka")
    if len(topic) > _MAX_TOPIC_LENGTH:
        raise InvalidTopicNameError(
            f"topic name {topic[:40]!r}... is {len(topic)} characters long; "
            f"Kafka allows at most {_MAX_TOPIC_LENGTH}"
        )
    if not _TOPIC_CHARS.fullmatch(topic):
        illegal = sorted({char for char in topic if not _TOPIC_CHARS.fullmatch(char)})
        raise InvalidTopicNameError(
            f"topic name {topic!r} contains {''.join(illegal)!r}; "
            "Kafka allows only ASCII letters, digits, '.', '_' and '-'"
        )
    if "." in topic and "_" in topic:
        warnings.warn(
            f"topic name {topic!r} mixes '.' and '_', which collide in Kafka metric names; "
            "use one or the other",
            TopicNameWarning,
            stacklevel=4,
        )


@dataclass(frozen=True, slots=True)
class EventType(Generic[M]):
    """One durable event type, as declared in a :class:`Registry`. Do not mutate ``schema``.

    Attributes:
        name: the event type name, e.g. ``transfer.completed`` (the ``eventType`` header).
        model: the pydantic model of its events.
        topic: the one Kafka topic its events go to.
        key: the model field holding the aggregate id, which becomes the Kafka key.
        aggregate: the aggregate type, e.g. ``transfer``.
        version: the schema version, the ``N`` of ``schemas/<name>/v<N>.avsc``.
        encoding: how values are written (see :data:`Encoding`).
        schema: the Avro schema derived from the model (the committed contract).
        fingerprint: the 8-byte CRC-64-AVRO fingerprint of ``schema``'s canonical form.
    """

    name: str
    model: type[M]
    topic: str
    key: str
    aggregate: str
    version: int
    encoding: Encoding
    schema: dict[str, Any]
    fingerprint: bytes

    def key_of(self, event: M) -> str:
        """Return the Kafka key of ``event``: its key field as a string (UUIDs hyphenated)."""
        return str(getattr(event, self.key))


class Registry:
    """The durable event types of an application: name -> topic, key, schema and encoding.

    Lookups by name (:meth:`get`) and by model class (:meth:`for_model`) raise
    :class:`UnknownEventTypeError` naming what was asked for; they never return ``None``.
    """

    def __init__(self, *, topic_prefix: str = "") -> None:
        """Raises :class:`InvalidTopicNameError` when ``topic_prefix`` has characters Kafka
        refuses in topic names, or leaves no room for an event type's name."""
        if topic_prefix and (
            not _TOPIC_CHARS.fullmatch(topic_prefix) or len(topic_prefix) >= _MAX_TOPIC_LENGTH
        ):
            raise InvalidTopicNameError(
                f"topic prefix {topic_prefix[:60]!r} must be fewer than {_MAX_TOPIC_LENGTH} "
                "characters of ASCII letters, digits, '.', '_' and '-'"
            )
        self.topic_prefix = topic_prefix
        self._by_name: dict[str, EventType[Any]] = {}
        self._by_model: dict[type[BaseModel], EventType[Any]] = {}
        self._topic_owners: dict[str, str] = {}

    def event(
        self,
        name: str,
        *,
        key: str,
        aggregate: str,
        version: int = 1,
        topic: str | None = None,
        encoding: Encoding = "avro",
    ) -> Callable[[type[M]], type[M]]:
        """Class decorator form of :meth:`register`; returns the model class unchanged."""

        def decorate(model: type[M]) -> type[M]:
            self.register(
                model,
                name=name,
                key=key,
                aggregate=aggregate,
                version=version,
                topic=topic,
                encoding=encoding,
            )
            return model

        return decorate

    def register(
        self,
        model: type[M],
        *,
        name: str,
        key: str,
        aggregate: str,
        version: int = 1,
        topic: str | None = None,
        encoding: Encoding = "avro",
    ) -> EventType[M]:
        """Declare ``model`` as the durable event type ``name`` and return its :class:`EventType`.

        Args:
            model: a pydantic model with an Avro mapping (see :mod:`oncely.events.avro`).
            name: event type name: dot-separated parts of ``[A-Za-z0-9_-]``.
            key: the model field holding the aggregate id (``str``, ``int`` or ``UUID``).
            aggregate: the aggregate type the key identifies, e.g. ``transfer``.
            version: schema version, from 1; bump it whenever the schema changes.
            topic: the topic, by default ``topic_prefix + name``.
            encoding: ``"avro"`` (default), ``"avro-confluent"`` or ``"json"``.

        Raises:
            DuplicateEventTypeError: ``name`` or ``model`` is already registered.
            DuplicateTopicError: a topic is taken, or collides with one in Kafka metric names.
            InvalidTopicNameError: a topic is not a legal Kafka topic name.
            EventDeclarationError: bad name, key field, version or encoding.
            SchemaDerivationError: the model has no Avro mapping (names the field).
        """
        self._check_declaration(model, name=name, key=key, aggregate=aggregate, version=version)
        if encoding not in ENCODINGS:
            raise EventDeclarationError(
                f"event type {name!r}: encoding {encoding!r} is not one of {', '.join(ENCODINGS)}"
            )
        main_topic = self.topic_prefix + name if topic is None else topic
        validate_topic_name(main_topic)
        self._check_topic_free(main_topic, owner=f"event type {name!r}")
        schema = event_schema(model, event_type=name)
        event_type = EventType(
            name=name,
            model=model,
            topic=main_topic,
            key=key,
            aggregate=aggregate,
            version=version,
            encoding=encoding,
            schema=schema,
            fingerprint=fingerprint(schema),
        )
        self._by_name[name] = event_type
        self._by_model[model] = event_type
        _registry_of_model[model] = self
        self._topic_owners[main_topic] = f"event type {name!r}"
        return event_type

    def get(self, name: str) -> EventType[Any]:
        """Return the event type called ``name``.

        Raises:
            UnknownEventTypeError: ``no durable topic registered for event type 'x.y'``.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownEventTypeError(
                f"no durable topic registered for event type {name!r}"
            ) from None

    def for_model(self, model: type[M]) -> EventType[M]:
        """Return the event type whose model is exactly ``model``.

        Raises:
            UnknownEventTypeError: the class is not a registered event model (names it).
        """
        try:
            event_type: EventType[M] = self._by_model[model]
        except (KeyError, TypeError):
            described = getattr(model, "__qualname__", repr(model))
            raise UnknownEventTypeError(
                f"no durable topic registered for event model {described}; declare it with "
                "@registry.event(...)"
            ) from None
        return event_type

    def topic_for(self, name: str) -> str:
        """Return the topic of the event type ``name`` (raises :class:`UnknownEventTypeError`)."""
        return self.get(name).topic

    def topics(self) -> list[str]:
        """Return every topic of the registry, sorted."""
        return sorted(self._topic_owners)

    def __iter__(self) -> Iterator[EventType[Any]]:
        """Iterate over the event types in declaration order."""
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def _check_declaration(
        self, model: type[BaseModel], *, name: str, key: str, aggregate: str, version: int
    ) -> None:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise EventDeclarationError(
                f"event type {name!r}: {model!r} is not a pydantic BaseModel subclass"
            )
        if not _EVENT_TYPE_NAME.fullmatch(name) or len(name) > _MAX_TOPIC_LENGTH:
            raise EventDeclarationError(
                f"event type name {name!r} must be dot-separated parts of [A-Za-z0-9_-], "
                f"at most {_MAX_TOPIC_LENGTH} characters"
            )
        if name in self._by_name:
            raise DuplicateEventTypeError(f"event type {name!r} is already registered")
        if model in self._by_model:
            raise DuplicateEventTypeError(
                f"model {model.__qualname__} is already registered as event type "
                f"{self._by_model[model].name!r}; one model, one event type"
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise EventDeclarationError(
                f"event type {name!r}: version must be an integer >= 1, not {version!r}"
            )
        if not aggregate:
            raise EventDeclarationError(f"event type {name!r}: aggregate must not be empty")
        _check_key_field(model, name=name, key=key)

    def _check_topic_free(self, topic: str, *, owner: str) -> None:
        if topic in self._topic_owners:
            raise DuplicateTopicError(
                f"topic {topic!r} of {owner} is already the topic of {self._topic_owners[topic]}"
            )
        metric_name = topic.replace(".", "_")
        for taken, taken_by in self._topic_owners.items():
            if taken.replace(".", "_") == metric_name:
                raise DuplicateTopicError(
                    f"topic {topic!r} of {owner} collides with {taken!r} of {taken_by} "
                    "in Kafka metric names ('.' and '_' are the same there)"
                )


def _check_key_field(model: type[BaseModel], *, name: str, key: str) -> None:
    info = model.model_fields.get(key)
    if info is None:
        fields = ", ".join(model.model_fields) or "none"
        raise EventDeclarationError(
            f"event type {name!r}: key field {key!r} is missing from model "
            f"{model.__qualname__} (fields: {fields})"
        )
    annotation = info.annotation
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if annotation not in _KEY_TYPES:
        raise EventDeclarationError(
            f"event type {name!r}: key field {model.__qualname__}.{key} is {annotation!r}; "
            "a Kafka key needs a str, int or UUID that is never None"
        )


_registry_of_model: weakref.WeakKeyDictionary[type[BaseModel], Registry] = (
    weakref.WeakKeyDictionary()
)


def registry_of(model: type[BaseModel]) -> Registry:
    """The :class:`Registry` that declared ``model`` as an event type.

    Raises:
        UnknownEventTypeError: ``model`` was never declared with ``@registry.event(...)``.
    """
    try:
        return _registry_of_model[model]
    except KeyError:
        raise UnknownEventTypeError(
            f"{model.__qualname__} is not a durable event type: declare it with "
            "@registry.event(...)"
        ) from None
