"""The guard: whether a partition of the outbox or the receipts may be dropped now, or what it
waits for, decided from facts gathered by :mod:`oncely.retention.maintenance` (pure logic).

An outbox partition goes only when every row in it is past every shard's recorded progress and
its range ended before the republish horizon. Its dead, delayed or blocked rows and the rows
held behind a parked key do not keep it: the drop keeps them aside for the relay
(:mod:`oncely.storage.stores.outbox.kept`). A receipts partition goes only when none of its
events can be delivered again. Its range ended before the receipts horizon and the outbox no
longer holds its events, its rows kept aside included (so no republish of this database, and no
release by the relay, can reach them); then a *mark* is taken: for each topic its
receipts name, every partition's high watermark at that moment. Every copy of its events that
Kafka held then lies below the mark, whatever its offset or partition: the record a consumer
receipted, a republish's copy at a higher offset, a relay's duplicate. The partition goes once
every marked partition's log start has reached its mark (or the topic is deleted), and while
every receipt in it is covered by the mark (on a marked partition, below the mark). The limit:
a copy produced after the mark by something other than this database's outbox (another
service's republish of these events) is not seen; such a republish must stay within this
receipts horizon. A receipt without a Kafka position (topic, partition or offset ``NULL``) was
not written by a consumer reading Kafka (oncely's consumers always record where they read):
the guard cannot tell whether Kafka still holds its event, so its partition stays until the
receipt is deleted. Partitions go oldest first: one refused holds back every later one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from oncely.storage.partitions import KEPT_TABLE, Partition


@dataclass(frozen=True)
class OutboxFacts:
    """What an outbox partition holds that could still need it.

    Attributes:
        unpassed_shards: shards whose progress has not passed the partition's last row.
    """

    unpassed_shards: Sequence[int] = ()


@dataclass(frozen=True)
class Watermarks:
    """A Kafka partition's log start offset (the lowest offset it still holds) and its high
    watermark (the offset of its next record)."""

    low: int
    high: int


#: topic -> its partitions' watermarks, ``None`` when Kafka says the topic does not exist; a
#: topic missing: Kafka was not asked, or did not answer (never read as deleted).
KafkaAnswer = Mapping[str, Mapping[int, Watermarks] | None]


@dataclass(frozen=True)
class Mark:
    """Kafka's high watermarks when a receipts partition first became otherwise droppable.

    Attributes:
        highs: topic -> partition -> its high watermark then; ``None``: the topic did not exist.
        receipted: (topic, partition) -> the highest offset receipted there when marked (later
            plans read it instead of scanning the partition; the check at drop time scans).
    """

    highs: Mapping[str, Mapping[int, int] | None]
    receipted: Mapping[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReceiptsFacts:
    """What could deliver a receipts partition's records again.

    Attributes:
        outbox_rows: the outbox partition that still holds events of the partition's range
            (its default one when a row of the range came after its partition was dropped),
            ``None`` when none does (``oncely_relay_kept`` when only its rows of parked keys,
            kept aside, do).
        unplaced: how many of its receipts have no Kafka position (topic, partition or offset
            ``NULL``).
        highest_offsets: (topic, partition) -> the highest offset receipted there.
        mark: the partition's mark, ``None`` if none was taken yet.
        kafka: Kafka's answer about the marked topics.
        unanswered: the topics Kafka did not answer about when the mark was to be taken.
    """

    outbox_rows: str | None = None
    unplaced: int = 0
    highest_offsets: Mapping[tuple[str, int], int] = field(default_factory=dict)
    mark: Mark | None = None
    kafka: KafkaAnswer = field(default_factory=dict)
    unanswered: Sequence[str] = ()


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
    if facts.unpassed_shards:
        shards = ", ".join(str(s) for s in facts.unpassed_shards[:5])
        more = "..." if len(facts.unpassed_shards) > 5 else ""
        return f"the relay has not passed all its rows yet (shard(s) {shards}{more})"
    return None


def receipts_reason(
    partition: Partition, facts: ReceiptsFacts, *, now: datetime, horizon: timedelta
) -> str | None:
    """Why the receipts ``partition`` must stay, or ``None`` if it may be dropped: the
    database's facts first, then its mark, then Kafka's answer about the marked topics."""
    if (reason := database_reason(partition, facts, now=now, horizon=horizon)) is not None:
        return reason
    if facts.mark is None and facts.unanswered:
        topics = ", ".join(facts.unanswered)
        return f"Kafka did not answer about {topics} (not known to be deleted): not marked yet"
    if facts.mark is None:
        return NOT_MARKED if facts.highest_offsets else None  # nothing receipted: no mark
    if (reason := uncovered(facts.highest_offsets, facts.mark)) is not None:
        return reason
    for topic, highs in sorted(facts.mark.highs.items()):
        if highs is None:
            continue  # the topic did not exist when marked
        if topic not in facts.kafka:
            return f"Kafka did not answer about {topic} (marked, not known to be deleted)"
        found = facts.kafka[topic]
        if found is None:
            continue  # deleted since
        for number, high in sorted(highs.items()):
            if number not in found:
                return f"Kafka no longer lists {topic} [{number}], marked at {high}"
            if found[number].low < high:
                return (
                    f"Kafka still holds {topic} [{number}] from offset {found[number].low}, "
                    f"marked at {high}: a redelivery could apply its events again (the "
                    "topic's retention.ms deletes them)"
                )
    return None


#: The reason of a receipts partition that waits for its mark.
NOT_MARKED = (
    "Kafka's high watermarks are not marked yet (`oncely retention run` marks them once Kafka "
    "answers about its topics)"
)


def database_reason(
    partition: Partition, facts: ReceiptsFacts, *, now: datetime, horizon: timedelta
) -> str | None:
    """Why the receipts ``partition`` must stay whatever Kafka says (its range, the outbox, its
    receipts without a Kafka position), or ``None``: its mark and Kafka decide."""
    if (reason := _range_reason(partition, now=now, horizon=horizon)) is not None:
        return reason
    if facts.outbox_rows is not None:
        reason = f"the outbox still holds its events in {facts.outbox_rows}"
        if facts.outbox_rows.endswith("_default"):
            reason += (
                " (staged after their range's partition was dropped: retention deletes them once"
                " the relay has passed them and they are past the outbox horizon)"
            )
        if facts.outbox_rows == KEPT_TABLE:
            return reason + (
                " (rows of parked keys kept aside when their partition was dropped: a long delay,"
                " a dead row or a missing topic; the relay publishes them once their key is"
                " released, `oncely dead list --delayed`)"
            )
        return reason + "; a republish could deliver them again"
    if facts.unplaced:
        return (
            f"{facts.unplaced} receipt(s) without a Kafka position (not written by a consumer "
            "reading Kafka): whether Kafka still holds their events is unknown; delete them "
            "once it does not"
        )
    return None


def uncovered(highest_offsets: Mapping[tuple[str, int], int], mark: Mark) -> str | None:
    """Which receipt ``mark`` does not cover (one on a topic partition it did not mark, or at
    or above its mark there), or ``None``: every receipt is covered."""
    for (topic, number), offset in sorted(highest_offsets.items()):
        if topic in mark.highs and mark.highs[topic] is None:
            continue  # the topic did not exist when marked: Kafka held none of its records
        high = (mark.highs.get(topic) or {}).get(number)
        if high is None or offset >= high:
            at = "not marked" if high is None else f"marked at {high}"
            return f"a receipt of {topic} [{number}] at offset {offset} is not covered ({at})"
    return None


def mark_of(highest_offsets: Mapping[tuple[str, int], int], kafka: KafkaAnswer) -> Mark | None:
    """The mark of a partition whose receipts' highest offsets are ``highest_offsets``, from
    Kafka's answer about their topics; ``None`` when Kafka did not answer about one of them."""
    highs: dict[str, Mapping[int, int] | None] = {}
    for topic in sorted({topic for topic, _ in highest_offsets}):
        if topic not in kafka:
            return None
        found = kafka[topic]
        highs[topic] = None if found is None else {n: w.high for n, w in found.items()}
    return Mark(highs, dict(highest_offsets))


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
