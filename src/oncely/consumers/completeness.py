"""Completeness: the committed events an effect has neither applied nor dead-lettered, once they
are older than a grace period.

:func:`check_effect` answers for one effect, in the caller's transaction; the consumer process
runs it for its effects every ``ONCELY_COMPLETENESS_INTERVAL_SECONDS`` and exports
``oncely_effect_missing_events{effect}`` (:class:`CompletenessWatch`), and ``oncely status``
(:func:`oncely.ops.status.collect_status`) shows it. Settings: :class:`CompletenessSettings`.

An outbox row is **missing** for an effect when all of these hold:

- its type is one of the effect's event types (an event it does not subscribe to is expected
  of it never);
- it is published: its shard's recorded progress passed it, and it is neither a parked key's
  own row (dead, or delayed) nor held behind one (not published yet, not missing);
- it was not given up with ``oncely dead skip`` (``oncely_relay_skipped``);
- the effect holds no receipt for it, and did not dead-letter it (``oncely_dead_lettered``: a
  record sent to the effect's DLQ counts as dead, not missing);
- it is in the window: staged (the time in its UUIDv7 id) at or after the later of ``now -
  window_seconds`` and the oldest row still in the outbox (rows purged by retention are out of
  it), and before ``now - grace_seconds`` rounded down to a bucket edge.

The check is bounded by the window, not the table: the window is cut into buckets of
``bucket_seconds``; a bucket is an id range (a UUIDv7 starts with its time in milliseconds), so
each bucket's outbox rows and receipts are index ranges of the two primary keys. Per bucket the
rows of the effect's types are compared with its receipts and dead letters by count and by the
sum of the ids' hashes; only buckets that disagree (events not yet applied, dead or skipped
rows, receipts of events since purged) are read event by event. Two different sets of ids with
the same count and the same hash sum would hide a missing event: the sums of 32-bit hashes
collide with a probability of about 2^-32.

A row staged long before it committed (a long transaction) gets an id older than its commit:
it can count as missing from its commit until the consumer applies it, like any event the
consumer is late for. The alert waits (``for:``) for that reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from oncely.consumers.effects import Effect
from oncely.ids import lowest_of_millis, millis_of
from oncely.runtime.metrics import ConsumerMetrics
from oncely.settings import CompletenessSettings
from oncely.storage.stores import receipts
from oncely.storage.stores.receipts import BucketCounts, CompletenessBounds

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EffectCompleteness:
    """One effect's completeness over ``[window_start, window_end)`` (both ``None`` when there
    was nothing to check: an empty outbox, or a window shorter than the grace period).

    ``missing``: events it should have applied and has not (see the module); ``oldest_missing_at``:
    the oldest one's ``created_at``; ``sample_ids``: the first of them, oldest first, at most
    ``ONCELY_COMPLETENESS_SAMPLE_SIZE``. ``buckets``: buckets compared by count;
    ``buckets_read``: those that disagreed and were read event by event.
    """

    effect: str
    missing: int
    oldest_missing_at: datetime | None
    window_start: datetime | None
    window_end: datetime | None
    sample_ids: list[UUID] = field(default_factory=list)
    buckets: int = 0
    buckets_read: int = 0

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready data: ids as strings, times in ISO-8601."""
        return {
            "effect": self.effect,
            "missing": self.missing,
            "oldest_missing_at": _iso(self.oldest_missing_at),
            "window_start": _iso(self.window_start),
            "window_end": _iso(self.window_end),
            "sample_ids": [str(i) for i in self.sample_ids],
            "buckets": self.buckets,
            "buckets_read": self.buckets_read,
        }


def window(bounds: CompletenessBounds, settings: CompletenessSettings) -> tuple[int, int] | None:
    """The window to check, ``(start_ms, end_ms)``, or ``None`` when it is empty: it starts at
    the later of ``now - window`` and the oldest kept row, and ends at ``now - grace`` rounded
    down to a bucket edge (only closed buckets)."""
    if bounds.oldest_id is None:
        return None
    width = _ms(settings.bucket_seconds)
    end = (bounds.now_ms - _ms(settings.grace_seconds)) // width * width
    start = max(bounds.now_ms - _ms(settings.window_seconds), millis_of(bounds.oldest_id))
    return (start, end) if start < end else None


def bucket_edges(start_ms: int, end_ms: int, width_ms: int) -> list[int]:
    """The edges of the buckets that cover ``[start_ms, end_ms)``: ``start_ms``, every multiple
    of ``width_ms`` in between, and ``end_ms`` (so the first bucket may be shorter)."""
    first = (start_ms // width_ms + 1) * width_ms
    return [start_ms, *range(first, end_ms, width_ms), end_ms]


def disagreeing(counts: Sequence[BucketCounts]) -> list[int]:
    """The indexes of the buckets whose outbox rows and applied-or-dead events differ, by
    count or by the sum of their ids' hashes."""
    return [
        n
        for n, bucket in enumerate(counts)
        if bucket.events != bucket.done or bucket.events_hash != bucket.done_hash
    ]


def check_effect(
    conn: sa.Connection,
    *,
    effect: str,
    types: Sequence[str],
    settings: CompletenessSettings,
) -> EffectCompleteness:
    """The completeness of ``effect``, which consumes the event types named ``types``, read
    in ``conn``'s transaction (a REPEATABLE READ one keeps the counts and the rows in
    agreement). Raises SQLAlchemy's errors."""
    bounds = receipts.completeness_bounds(conn)
    span = window(bounds, settings)
    if span is None:
        return EffectCompleteness(effect, 0, None, None, None)
    edges = [lowest_of_millis(ms) for ms in bucket_edges(*span, _ms(settings.bucket_seconds))]
    lows, highs = edges[:-1], edges[1:]
    counts = receipts.bucket_counts(conn, effect=effect, types=types, lows=lows, highs=highs)
    read = disagreeing(counts)
    found = receipts.missing_events(
        conn,
        effect=effect,
        types=types,
        lows=[lows[n] for n in read],
        highs=[highs[n] for n in read],
        limit=settings.sample_size,
    )
    return EffectCompleteness(
        effect=effect,
        missing=found.missing,
        oldest_missing_at=found.oldest_created_at,
        window_start=_time(span[0]),
        window_end=_time(span[1]),
        sample_ids=found.sample,
        buckets=len(lows),
        buckets_read=len(read),
    )


def check_effects(
    conn: sa.Connection, effects: Iterable[Effect], settings: CompletenessSettings
) -> list[EffectCompleteness]:
    """:func:`check_effect` for each of ``effects``, in ``conn``'s transaction."""
    return [
        check_effect(
            conn,
            effect=effect.name,
            types=[t.name for t in effect.event_types],
            settings=settings,
        )
        for effect in effects
    ]


class CompletenessWatch:
    """The consumer process's duty: every ``settings.interval_seconds`` check its effects'
    completeness, each in a READ ONLY snapshot, and set ``oncely_effect_missing_events`` and
    ``oncely_effect_completeness_check_seconds``. A check that fails (the database down) logs a
    WARNING and leaves the gauges as they were; the consumers are not disturbed."""

    def __init__(
        self,
        engine: sa.Engine,
        effects: Sequence[Effect],
        settings: CompletenessSettings,
        metrics: ConsumerMetrics,
    ) -> None:
        self.engine = engine
        self.effects = effects
        self.settings = settings
        self.metrics = metrics
        self._reported: dict[str, int] = {}

    def run(self, stop: threading.Event) -> None:
        """Check at once, then every interval, until ``stop`` is set."""
        while not stop.is_set():
            for effect in self.effects:
                if stop.is_set():
                    return
                self.check(effect)
            stop.wait(self.settings.interval_seconds)

    def check(self, effect: Effect) -> EffectCompleteness | None:
        """Check ``effect`` once and export the result; ``None`` when the check failed."""
        started = time.monotonic()
        conn = self.engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        )
        try:
            with conn, conn.begin():
                [result] = check_effects(conn, [effect], self.settings)
        except sa.exc.SQLAlchemyError as exc:
            log.warning(
                "could not check the completeness of effect %s: %s",
                effect.name,
                exc,
                extra={"effect": effect.name},
            )
            return None
        self.metrics.missing_events.labels(effect.name).set(result.missing)
        self.metrics.completeness_seconds.labels(effect.name).set(time.monotonic() - started)
        if result.missing and self._reported.get(effect.name) != result.missing:
            log.warning(
                "effect %s has %d missing events (older than %g s, no receipt), oldest %s: %s",
                effect.name,
                result.missing,
                self.settings.grace_seconds,
                _iso(result.oldest_missing_at),
                ", ".join(map(str, result.sample_ids)),
                extra={"effect": effect.name, "missing": result.missing},
            )
        self._reported[effect.name] = result.missing
        return result


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _time(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()
