"""The guard: whether a partition of the outbox or the receipts may be dropped now, or what it
waits for, decided from facts gathered by :mod:`oncely.retention.maintenance` (pure logic).

An outbox partition goes only when every row in it is past every shard's recorded progress,
none is dead, delayed, blocked or held behind a parked key, and its range ended before the
republish horizon. A receipts partition goes only when none of its records can be delivered
again: Kafka has deleted every record it receipted (each topic partition's log start offset is
past the highest offset receipted there) and the outbox no longer holds its events, so no
republish can reach them. Partitions go oldest first: one refused holds back every later one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from oncely.storage.partitions import Partition


@dataclass(frozen=True)
class OutboxFacts:
    """What an outbox partition holds that could still need it.

    Attributes:
        unpassed_shards: shards whose progress has not passed the partition's last row.
        parked: parked rows of the partition by reason (``dead``, ``delayed``, ``blocked``).
        held: rows of the partition held behind a parked key.
    """

    unpassed_shards: Sequence[int] = ()
    parked: Mapping[str, int] = field(default_factory=dict)
    held: int = 0


@dataclass(frozen=True)
class ReceiptsFacts:
    """What could deliver a receipts partition's records again.

    Attributes:
        outbox_rows: the outbox partition that still holds events of the partition's range
            (its default one when a row of the range came after its partition was dropped),
            ``None`` when none does.
        highest_offsets: (topic, partition) -> the highest offset receipted there.
        log_starts: (topic, partition) -> Kafka's log start offset, ``None`` when the topic or
            partition no longer exists; missing: Kafka was not asked (or did not answer).
    """

    outbox_rows: str | None = None
    highest_offsets: Mapping[tuple[str, int], int] = field(default_factory=dict)
    log_starts: Mapping[tuple[str, int], int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """A partition's fate: ``reason`` is ``None`` when it may be dropped, else one line saying
    what it waits for."""

    partition: Partition
    reason: str | None

    @property
    def droppable(self) -> bool:
        return self.reason is None


def outbox_reason(
    partition: Partition, facts: OutboxFacts, *, now: datetime, horizon: timedelta
) -> str | None:
    """Why the outbox ``partition`` must stay, or ``None`` if it may be dropped."""
    if (reason := _range_reason(partition, now=now, horizon=horizon)) is not None:
        return reason
    if facts.parked:
        kinds = ", ".join(f"{n} {reason}" for reason, n in sorted(facts.parked.items()))
        return f"holds parked rows ({kinds}): requeue or skip them (`oncely dead list`)"
    if facts.held:
        return f"holds {facts.held} row(s) held behind a parked key (`oncely dead list`)"
    if facts.unpassed_shards:
        shards = ", ".join(str(s) for s in facts.unpassed_shards[:5])
        more = "..." if len(facts.unpassed_shards) > 5 else ""
        return f"the relay has not passed all its rows yet (shard(s) {shards}{more})"
    return None


def receipts_reason(
    partition: Partition, facts: ReceiptsFacts, *, now: datetime, horizon: timedelta
) -> str | None:
    """Why the receipts ``partition`` must stay, or ``None`` if it may be dropped."""
    if (reason := _range_reason(partition, now=now, horizon=horizon)) is not None:
        return reason
    if facts.outbox_rows is not None:
        reason = f"the outbox still holds its events in {facts.outbox_rows}"
        if facts.outbox_rows.endswith("_default"):
            reason += (
                " (staged after their range's partition was dropped: retention deletes them once"
                " the relay has passed them and they are past the outbox horizon)"
            )
        return reason + "; a republish could deliver them again"
    for (topic, number), offset in sorted(facts.highest_offsets.items()):
        if (topic, number) not in facts.log_starts:
            return f"Kafka did not say where {topic} [{number}] starts (receipted up to {offset})"
        start = facts.log_starts[(topic, number)]
        if start is not None and start <= offset:
            return (
                f"Kafka still holds {topic} [{number}] from offset {start}, receipted up to "
                f"{offset}: a redelivery could apply them again (the topic's retention.ms "
                "deletes them)"
            )
    return None


def _range_reason(partition: Partition, *, now: datetime, horizon: timedelta) -> str | None:
    if partition.upper is None:
        return "the default partition is never dropped (retention deletes its rows that may go)"
    if partition.upper > now - horizon:
        return f"its range ends at {partition.upper:%Y-%m-%d %H:%M:%S}Z, within the horizon"
    return None


def in_order(
    closed: Sequence[Partition], reason_of: Callable[[Partition], str | None]
) -> list[Verdict]:
    """The verdicts of ``closed`` (one table's partitions, oldest first), asking ``reason_of``
    until a partition must stay: every later one then waits for it (partitions go oldest first,
    so what is retained stays one contiguous range)."""
    verdicts: list[Verdict] = []
    blocker: Partition | None = None
    for partition in closed:
        if blocker is not None:
            verdicts.append(Verdict(partition, f"waits for the older {blocker.name}"))
            continue
        verdict = Verdict(partition, reason_of(partition))
        if not verdict.droppable:
            blocker = partition
        verdicts.append(verdict)
    return verdicts
