"""The retention guard's pure decisions (:mod:`oncely.retention.guard`): every reason a
partition stays, and partitions going oldest first."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from oncely.retention import Plan, Verdict, policy_of
from oncely.retention.guard import (
    NOT_MARKED,
    Mark,
    OutboxFacts,
    ReceiptsFacts,
    Watermarks,
    in_order,
    mark_of,
    outbox_reason,
    receipts_reason,
)
from oncely.retention.report import document, kept_past_horizon
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage.partitions import Partition

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
HORIZON = timedelta(days=7)


def _partition(days_ago: int, table: str = "oncely_outbox") -> Partition:
    lower = NOW - DAY * days_ago
    return Partition(table, f"{table}_p{lower:%Y%m%dt%H%M%S}", lower, lower + DAY, 8192)


OLD = _partition(10)
DEFAULT = Partition("oncely_outbox", "oncely_outbox_default", None, None, 8192)


def _outbox(partition: Partition, facts: OutboxFacts | None = None) -> str | None:
    return outbox_reason(partition, facts or OutboxFacts(), now=NOW, horizon=HORIZON)


def _receipts(facts: ReceiptsFacts, partition: Partition | None = None) -> str | None:
    old = partition or _partition(10, "oncely_receipts")
    return receipts_reason(old, facts, now=NOW, horizon=HORIZON)


def test_an_outbox_partition_past_the_horizon_with_nothing_pending_may_go() -> None:
    assert _outbox(OLD) is None


def test_the_default_partition_is_never_dropped() -> None:
    assert "default partition is never dropped" in str(_outbox(DEFAULT))


def test_a_partition_within_the_horizon_stays() -> None:
    recent = _partition(7)  # its range ends 6 days ago: within 7 days
    assert "within the horizon" in str(_outbox(recent))
    assert "within the horizon" in str(_receipts(ReceiptsFacts(), _partition(7, "x")))
    assert _outbox(_partition(8)) is None  # ended exactly 7 days ago: past it


def test_an_outbox_partition_with_unpassed_rows_stays() -> None:
    # Parked and held rows do not keep it (F8): the drop keeps them aside for the relay.
    unpassed = _outbox(OLD, OutboxFacts(unpassed_shards=list(range(7))))
    assert unpassed is not None and "shard(s) 0, 1, 2, 3, 4..." in unpassed


def test_a_receipts_partition_stays_until_kafka_passes_its_mark() -> None:
    held = ReceiptsFacts(outbox_rows="oncely_outbox_p20261206t000000")
    assert "outbox still holds its events in oncely_outbox_p20261206t000000" in str(_receipts(held))
    offsets = {("t", 0): 41}
    assert _receipts(ReceiptsFacts(highest_offsets=offsets)) == NOT_MARKED
    assert _receipts(ReceiptsFacts()) is None  # nothing receipted: nothing to protect
    # Marked at the high watermarks of every partition of t: 50 on 0 (a copy above the
    # receipted 41), 7 on 1 (no receipt there: a copy could be there too).
    mark = Mark({"t": {0: 50, 1: 7}}, offsets)
    marked = ReceiptsFacts(highest_offsets=offsets, mark=mark)
    assert "Kafka did not answer about t" in str(_receipts(marked))
    held = _receipts(replace(marked, kafka={"t": {0: Watermarks(42, 60), 1: Watermarks(7, 9)}}))
    assert held is not None and "Kafka still holds t [0] from offset 42, marked at 50" in held
    held = _receipts(replace(marked, kafka={"t": {0: Watermarks(50, 60), 1: Watermarks(6, 9)}}))
    assert held is not None and "Kafka still holds t [1] from offset 6, marked at 7" in held
    passed = {"t": {0: Watermarks(50, 60), 1: Watermarks(7, 9), 2: Watermarks(0, 3)}}
    assert _receipts(replace(marked, kafka=passed)) is None  # a partition added later: later
    # The topic is gone: Kafka holds none of its records.
    assert _receipts(replace(marked, kafka={"t": None})) is None


def test_a_receipt_the_mark_does_not_cover_keeps_the_partition() -> None:
    mark = Mark({"t": {0: 50}}, {("t", 0): 41})
    passed = {"t": {0: Watermarks(50, 60)}, "u": {0: Watermarks(9, 9)}}
    for offsets in ({("t", 0): 50}, {("t", 1): 3}, {("u", 0): 1}):
        reason = _receipts(ReceiptsFacts(highest_offsets=offsets, mark=mark, kafka=passed))
        assert reason is not None and "is not covered" in reason
    # A topic that did not exist when marked covers its receipts.
    gone = Mark({"t": None}, {})
    assert _receipts(ReceiptsFacts(highest_offsets={("t", 0): 9}, mark=gone)) is None


def test_a_mark_needs_an_answer_about_every_receipted_topic() -> None:
    offsets = {("t", 0): 41, ("u", 2): 5}
    answer = {"t": {0: Watermarks(3, 50), 1: Watermarks(0, 7)}, "u": None}
    assert mark_of(offsets, answer) == Mark({"t": {0: 50, 1: 7}, "u": None}, offsets)
    assert mark_of(offsets, {"t": answer["t"]}) is None  # no answer about u: not deleted


def test_receipts_without_a_kafka_position_keep_their_partition() -> None:
    reason = _receipts(ReceiptsFacts(unplaced=2, mark=Mark({})))
    assert reason is not None and "2 receipt(s) without a Kafka position" in reason


def test_partitions_go_oldest_first_behind_one_that_stays() -> None:
    closed = [_partition(n) for n in (12, 11, 10, 9)]
    stays = closed[1]
    asked: list[Partition] = []

    def reason_of(partition: Partition) -> str | None:
        asked.append(partition)
        return "held" if partition is stays else None

    verdicts = in_order(closed, reason_of)
    assert [v.partition for v in verdicts] == closed
    assert [v.droppable for v in verdicts] == [True, False, False, False]
    assert verdicts[1].reason == "held"
    assert verdicts[2].reason == f"waits for the older {stays.name}"
    assert asked == closed[:2]  # nothing later is asked once one stays
    assert in_order([], reason_of) == []


def test_kept_counts_only_partitions_past_their_horizon() -> None:
    policy = policy_of(RetentionSettings(), RelaySettings(), outbox_horizon=HORIZON)
    verdicts = [
        Verdict(_partition(12), None),
        Verdict(_partition(11), "parked"),
        Verdict(_partition(10), "waits for the older one"),
        Verdict(_partition(3), "its range ends within the horizon"),
    ]
    plan = Plan(DAY, NOW, [], verdicts, [])
    assert [v.partition for v in kept_past_horizon(plan, policy)] == [
        _partition(11),
        _partition(10),
    ]
    found = document(plan)
    assert found["executed"] is False
    assert found["verdicts"][1] == {
        "table": "oncely_outbox",
        "partition": _partition(11).name,
        "lower": _partition(11).lower,
        "upper": _partition(11).upper,
        "bytes": 8192,
        "droppable": False,
        "reason": "parked",
    }
