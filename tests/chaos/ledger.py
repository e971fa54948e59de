"""The ledger checker: the promise, checked from the raw tables and topics, independently of
``oncely verify``.

- every committed business transaction's event has exactly one effect per effect name;
- no effect exists for a rolled-back transaction;
- per key and effect, effects were applied in ``seq`` order (within the key's topic);
- Kafka duplicates (two records with one event id) are counted and reported, not failed.

What was staged is read from ``chaos_outbox``, the harness's mirror of every row inserted into
the outbox (retention drops the outbox's partitions during the scenarios).

The effect table of the test app (``ledger``) has no unique constraint of its own, so a broken
receipt shows up here as a duplicate effect.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import sqlalchemy as sa
from confluent_kafka import KafkaException

from tests.helpers import Record, read_topics


@dataclass
class LedgerReport:
    committed: int
    rolled_back: int
    published: int
    kafka_records: int
    kafka_duplicates: int
    lost: list[str] = field(default_factory=list)
    duplicate_effects: list[str] = field(default_factory=list)
    missing_effects: list[str] = field(default_factory=list)
    phantom_effects: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicate_effects
            or self.missing_effects
            or self.phantom_effects
            or self.order_violations
        )

    def summary(self) -> str:
        return (
            f"committed={self.committed} rolled_back={self.rolled_back} "
            f"published={self.published} kafka_records={self.kafka_records} "
            f"kafka_duplicates={self.kafka_duplicates} lost={len(self.lost)} "
            f"duplicate_effects={len(self.duplicate_effects)} "
            f"missing_effects={len(self.missing_effects)} phantom={len(self.phantom_effects)} "
            f"order_violations={len(self.order_violations)}"
        )


def _read(bootstrap: str, topics: list[str]) -> list[Record]:
    """Every record of ``topics``; metadata right after a broker restart may not know a
    partition yet (``_UNKNOWN_PARTITION``): ask again for up to 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return read_topics(bootstrap, topics)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def check(
    engine: sa.Engine, bootstrap: str, *, topics: list[str], effects: list[str]
) -> LedgerReport:
    with engine.connect() as conn:
        outbox = conn.execute(sa.text("SELECT id, seq, topic, aggregateid FROM chaos_outbox")).all()
        business = conn.execute(sa.text("SELECT event_id, committed FROM chaos_business")).all()
        effects_rows = conn.execute(
            sa.text("SELECT event_id, effect, account_id, applied_at FROM ledger")
        ).all()
    committed = {str(r.id) for r in outbox}
    rolled_back = {str(r.event_id) for r in business if not r.committed} - committed
    records = _read(bootstrap, topics)
    per_id = Counter(r.headers["id"].decode() for r in records)
    report = LedgerReport(
        committed=len(committed),
        rolled_back=len(rolled_back),
        published=published(engine),
        kafka_records=len(records),
        kafka_duplicates=sum(n - 1 for n in per_id.values() if n > 1),
    )
    report.lost = sorted(committed - set(per_id))
    applied: dict[tuple[str, str], list[object]] = defaultdict(list)
    for row in effects_rows:
        applied[(str(row.event_id), row.effect)].append(row.applied_at)
    seq = {str(r.id): (r.seq, r.topic, r.aggregateid) for r in outbox}
    for (event_id, effect), times in applied.items():
        if len(times) > 1:
            report.duplicate_effects.append(f"{effect}:{event_id} x{len(times)}")
        if event_id not in committed:
            report.phantom_effects.append(f"{effect}:{event_id}")
    for event_id in committed:
        for effect in effects:
            if (event_id, effect) not in applied:
                report.missing_effects.append(f"{effect}:{event_id}")
    for effect in effects:
        by_key: dict[tuple[str, str], list[tuple[object, int]]] = defaultdict(list)
        for (event_id, name), times in applied.items():
            if name == effect and event_id in seq:
                number, topic, key = seq[event_id]
                by_key[(topic, key)].append((min(times), number))  # type: ignore[type-var]
        for key, pairs in by_key.items():
            ordered = [number for _, number in sorted(pairs)]  # type: ignore[type-var]
            if ordered != sorted(ordered):
                report.order_violations.append(f"{effect}:{key}")
    return report


def published(engine: sa.Engine) -> int:
    """Staged events (the mirror's rows) the relay has recorded as acknowledged, held and dead
    rows not counted: ``tests.helpers.count_published`` on what retention has not dropped."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    """
                    SELECT count(*) FROM chaos_outbox AS o
                    JOIN oncely_relay_shards AS s ON s.shard = o.shard
                    WHERE oncely_passed(o.txid, o.seq, s.done, s.reading, s.after_seq)
                      AND o.id NOT IN (SELECT event_id FROM oncely_relay_held)
                      AND o.id NOT IN (SELECT event_id FROM oncely_relay_parked)
                    """
                )
            ).scalar_one()
        )
