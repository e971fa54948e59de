"""The Kafka record contract: what a record of an outbox row carries, whoever relays it.

A row becomes one record, the same from oncely's relay and from Debezium's Outbox Event Router
(the parity test holds them to it):

- topic: the row's ``topic``; key: ``aggregateid`` in UTF-8; value: ``payload`` as stored;
- headers: :data:`ID_HEADER` (the event id, 36 lowercase characters), :data:`EVENT_TYPE_HEADER`
  (the ``type`` column), then the row's own ``headers`` in their stored (``jsonb``) order, each
  value as UTF-8 text; the codec puts :data:`CONTENT_TYPE_HEADER` and
  :data:`SCHEMA_VERSION_HEADER` there, and an effect's follow-up event carries
  :data:`CAUSATION_HEADER`, the id of the event whose effect staged it;
- then the trace context staged with the row (``tracingspancontext``: :func:`trace_context_text`),
  one header per field (``traceparent``, ``tracestate``, ``baggage``); a relay that traces puts
  its own span's context there instead (Debezium's tracing SMT does the same);
- then, when the deployment opts in, the CloudEvents binary-mode headers of
  :func:`cloudevents_headers` (``ce_id``, ``ce_type``, ``ce_time``, ``ce_source``,
  ``ce_specversion``), the same from oncely's relay and from Debezium;
- timestamp: the row's ``created_at`` in whole milliseconds, rounded down (the statements that
  read rows return it in microseconds, from the database's clock).

A consumer reads headers as text with :func:`text_headers`, within :data:`MAX_HEADERS`,
:data:`MAX_HEADER_BYTES` and :data:`MAX_HEADERS_TOTAL_BYTES`. A record an effect gives up on
goes to :func:`dlq_topic` with the original headers and the ``oncely.dlq.*`` ones of
:func:`dlq_headers`.

A relay in exactly-once mode commits, with each transaction's records, a
:class:`ProgressRecord` of the shard they came from to :func:`progress_topic` (compacted, keyed
by shard): the position a relay taking the shard over starts from when it is ahead of the one
recorded in the database.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache

import javaproperties
import pydantic
from confluent_kafka import Message

from oncely.errors import error_text
from oncely.settings import CLOUDEVENTS_SOURCE_PATTERN

__all__ = [
    "CAUSATION_HEADER",
    "CLOUDEVENTS_HEADERS",
    "CLOUDEVENTS_SPECVERSION",
    "CONTENT_TYPE_HEADER",
    "DLQ_HEADER_PREFIX",
    "EVENT_TYPE_HEADER",
    "ID_HEADER",
    "MAX_HEADERS",
    "MAX_HEADERS_TOTAL_BYTES",
    "MAX_HEADER_BYTES",
    "SCHEMA_VERSION_HEADER",
    "Headers",
    "ProgressRecord",
    "check_cloudevents_source",
    "cloudevents_headers",
    "cloudevents_time",
    "dlq_headers",
    "dlq_topic",
    "id_header",
    "progress_topic",
    "read_progress_record",
    "record_headers",
    "row_headers",
    "text_headers",
    "trace_context_fields",
    "trace_context_text",
]

ID_HEADER = "id"
EVENT_TYPE_HEADER = "eventType"
CONTENT_TYPE_HEADER = "content-type"
SCHEMA_VERSION_HEADER = "schema-version"
#: On a follow-up event (``ctx.stage``): the id of the event whose effect staged it.
CAUSATION_HEADER = "causationId"

MAX_HEADER_BYTES = 64 * 1024
#: Bounds on all headers of one record together: no oncely record comes near them.
MAX_HEADERS = 1000
MAX_HEADERS_TOTAL_BYTES = 1024 * 1024

DLQ_HEADER_PREFIX = "oncely.dlq."

#: The CloudEvents binary-mode headers (Kafka protocol binding), in the order both relays add
#: them: three from the row (``id``, ``type``, ``created_at``), then the two constants.
CLOUDEVENTS_HEADERS = ("ce_id", "ce_type", "ce_time", "ce_source", "ce_specversion")
CLOUDEVENTS_SPECVERSION = "1.0"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: A row's own headers as Kafka headers: (name, UTF-8 value) in stored order.
Headers = tuple[tuple[str, bytes], ...]


@lru_cache(maxsize=4096)
def row_headers(text: str) -> Headers:
    """The Kafka headers of a row's ``headers`` column, given as ``jsonb`` text."""
    return tuple((name, str(value).encode()) for name, value in json.loads(text).items())


def record_headers(
    event_id: str,
    event_type: str,
    headers: Headers,
    trace: Headers = (),
    cloudevents: Headers = (),
) -> list[tuple[str, str | bytes | None]]:
    """A record's headers: the id, the event type, the row's own headers, the trace context,
    the CloudEvents headers."""
    result: list[tuple[str, str | bytes | None]] = [
        (ID_HEADER, event_id.encode()),
        (EVENT_TYPE_HEADER, event_type.encode()),
        *headers,
    ]
    if trace:
        result += trace
    if cloudevents:
        result += cloudevents
    return result


def trace_context_text(fields: Mapping[str, str]) -> str | None:
    """The trace context ``fields`` a propagator injected (``traceparent``, ``tracestate``,
    ``baggage``) as the Java properties text the ``tracingspancontext`` column holds, which
    Debezium's tracing SMT reads with ``java.util.Properties.load``; ``None`` when empty."""
    return javaproperties.dumps(fields, timestamp=None) if fields else None


def trace_context_fields(text: str | None) -> dict[str, str]:
    """The fields of a ``tracingspancontext`` text; empty for ``None`` or text that is not
    properties (a trace context is never a reason to refuse a row)."""
    if not text:
        return {}
    try:
        fields: dict[str, str] = javaproperties.loads(text)
    except ValueError:  # a malformed \u escape
        return {}
    return fields


def check_cloudevents_source(source: str) -> str:
    """``source`` if it can be the CloudEvents ``source`` attribute, else raise ``ValueError``.

    The attribute is a non-empty URI-reference (``/shop/orders``, ``urn:shop``,
    ``https://shop.example/orders``): visible ASCII characters, no spaces
    (:data:`~oncely.settings.CLOUDEVENTS_SOURCE_PATTERN`).
    """
    if not re.fullmatch(CLOUDEVENTS_SOURCE_PATTERN, source):
        raise ValueError(
            f"CloudEvents source {source!r} is not a URI-reference: give a non-empty value of "
            "visible ASCII characters without spaces, such as /shop/orders or urn:shop"
        )
    return source


def cloudevents_time(created_us: int) -> str:
    """``created_at`` (microseconds since the epoch) as RFC 3339 text in UTC, written as
    Debezium writes a ``timestamptz`` column (``ZonedTimestamp`` with the column's six fraction
    digits and a ``Z``), so both relays send the same ``ce_time``."""
    moment = _EPOCH + timedelta(microseconds=created_us)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cloudevents_headers(event_id: str, event_type: str, created_us: int, source: str) -> Headers:
    """The CloudEvents binary-mode headers of a row (:data:`CLOUDEVENTS_HEADERS`): the event id,
    the event type, ``created_at``, the deployment's ``source`` and the spec version. The
    record's ``content-type`` header (set by the codec) is CloudEvents' ``datacontenttype``."""
    return (
        ("ce_id", event_id.encode()),
        ("ce_type", event_type.encode()),
        ("ce_time", cloudevents_time(created_us).encode()),
        ("ce_source", source.encode()),
        ("ce_specversion", CLOUDEVENTS_SPECVERSION.encode()),
    )


def text_headers(message: Message) -> dict[str, str] | str:
    """The record's headers as text (the last value of a repeated name; no ``None`` values), or
    the reason they are unusable (not UTF-8, too many, too large)."""
    try:
        raw = message.headers() or []
    except (UnicodeDecodeError, ValueError) as exc:  # a header name that is not UTF-8
        return f"the headers cannot be read: {type(exc).__name__}"
    pairs = raw if type(raw) is list else list(raw.items() if isinstance(raw, dict) else raw)
    if len(pairs) > MAX_HEADERS:
        return f"the record has {len(pairs)} headers, more than {MAX_HEADERS}"
    if not pairs:
        return {}
    try:
        sizes = list(map(len, map(_VALUE, pairs)))
        if max(sizes) > MAX_HEADER_BYTES or (
            sum(sizes) + sum(map(len, map(_NAME, pairs))) > MAX_HEADERS_TOTAL_BYTES
        ):
            return _checked_headers(pairs)  # which bound
        return {name: value.decode() for name, value in pairs}  # type: ignore[union-attr]
    except (TypeError, UnicodeDecodeError, AttributeError):  # a None value, not UTF-8, a fake's
        return _checked_headers(pairs)


_NAME, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def _checked_headers(pairs: list[tuple[str, str | bytes | None]]) -> dict[str, str] | str:
    """:func:`text_headers` of ``pairs``, header by header."""
    headers: dict[str, str] = {}
    total = 0
    name = ""
    try:
        for name, value in pairs:
            if value is None:
                continue
            size = len(value)
            if size > MAX_HEADER_BYTES:
                return f"header {name[:64]!r} is {size} bytes long"
            total += len(name) + size
            if total > MAX_HEADERS_TOTAL_BYTES:
                return f"the headers are over {MAX_HEADERS_TOTAL_BYTES} bytes in all"
            headers[name] = value if isinstance(value, str) else value.decode()
    except UnicodeDecodeError:
        return f"header {name[:64]!r} is not UTF-8"
    return headers


def id_header(message: Message) -> str | None:
    """The record's :data:`ID_HEADER` as text, ``None`` when it has none or it is not UTF-8."""
    headers = text_headers(message)
    return None if isinstance(headers, str) else headers.get(ID_HEADER)


def dlq_topic(topic: str, effect: str) -> str:
    """The dead-letter topic of ``effect`` for records of ``topic``."""
    return f"{topic}.{effect}.dlq"


def dlq_headers(
    message: Message, *, effect: str, reason: str, error_class: str, error: str, attempts: int
) -> list[tuple[str, str | bytes | None]]:
    """The dead-letter record's headers: ``message``'s own, then why and where it came from."""
    raw = message.headers() or []
    original = list(raw.items() if isinstance(raw, dict) else raw)
    return [
        *original,
        (f"{DLQ_HEADER_PREFIX}reason", reason),
        (f"{DLQ_HEADER_PREFIX}error.class", error_class),
        (f"{DLQ_HEADER_PREFIX}error.message", error_text(error)),
        (f"{DLQ_HEADER_PREFIX}attempts", str(attempts)),
        (f"{DLQ_HEADER_PREFIX}effect", effect),
        (f"{DLQ_HEADER_PREFIX}original.topic", message.topic() or ""),
        (f"{DLQ_HEADER_PREFIX}original.partition", str(message.partition())),
        (f"{DLQ_HEADER_PREFIX}original.offset", str(message.offset())),
    ]


def progress_topic(prefix: str) -> str:
    """The compacted topic of the progress records of the relays whose transactional ids start
    with ``prefix``."""
    return f"{prefix}.progress"


@dataclass(frozen=True, slots=True)
class ProgressRecord:
    """A shard's position, committed with the records that reached it: every row visible in
    the snapshot ``done`` and, of ``reading`` (when set), every row up to ``after_seq``
    (snapshots in ``pg_snapshot`` text form); ``epoch`` is the lease it was written under.
    ``released``: the event ids of the shard's parked rows whose keys' rows a transaction
    published and whose unparking PostgreSQL may not have recorded yet."""

    shard: int
    epoch: int
    done: str
    reading: str | None = None
    after_seq: int = 0
    released: tuple[str, ...] = ()

    def key(self) -> bytes:
        """The record's key: the shard number in decimal (compaction keeps each shard's last)."""
        return str(self.shard).encode()

    def value(self) -> bytes:
        """The record's value: this, as JSON."""
        return _PROGRESS.dump_json(self)


_PROGRESS = pydantic.TypeAdapter(ProgressRecord)


def read_progress_record(value: bytes) -> ProgressRecord:
    """A progress record's value read back.

    Raises ``ValueError`` naming what is wrong when ``value`` is not one.
    """
    try:
        return _PROGRESS.validate_json(value)
    except pydantic.ValidationError as exc:
        raise ValueError(f"not an oncely progress record: {exc.errors()[0]['msg']}") from exc
