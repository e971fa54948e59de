"""The verdict on each failure (pure): backoff, dead letter, suspect, forget limits."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from confluent_kafka import KafkaError

from oncely.relay.failures import Failures, Verdict, overdue
from oncely.relay.shards import Failure, InFlight, Page
from oncely.relay.topics import TopicState, TopicWatch
from oncely.runtime.retry import Backoff
from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

END = Progress(Snapshot(1, 1, frozenset()))


def _row(topic: str = "t") -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), 1, 0, topic, "k", "e", b"x", (), 0)


def _failures() -> Failures:
    return Failures(max_attempts=2, delivery_timeout_ms=1000)


def test_overdue_and_transient_failures_back_off_and_never_go_dead() -> None:
    failures = _failures()
    assert failures.judge(0, None) == Verdict(backoff=True)
    row = _row()
    for _ in range(5):
        failure = Failure(row, KafkaError(KafkaError.NOT_ENOUGH_REPLICAS), own=True)
        assert failures.judge(0, failure) == Verdict(backoff=True)


def test_a_missing_topic_replays_at_once_to_park_its_rows() -> None:
    failure = Failure(_row(), KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART), own=True)
    assert _failures().judge(0, failure) == Verdict(backoff=False)


def test_a_permanent_error_not_its_own_makes_a_suspect_and_counts_nothing() -> None:
    failures = _failures()
    row = _row()
    shared = Failure(row, KafkaError(KafkaError.INVALID_RECORD), own=False)
    for _ in range(3):
        assert failures.judge(0, shared) == Verdict(backoff=False, forget_limits=True)
    assert row.id in failures.suspects
    failures.published([row])
    assert not failures.suspects


def test_its_own_permanent_error_dead_letters_after_max_attempts() -> None:
    failures = _failures()
    row = _row()
    own = Failure(row, KafkaError(KafkaError.INVALID_RECORD), own=True)
    assert failures.judge(0, own) == Verdict(backoff=True, forget_limits=True)
    verdict = failures.judge(0, own)
    assert verdict.backoff and verdict.dead_letter is not None
    assert verdict.dead_letter.startswith("INVALID_RECORD")


def test_a_dead_letter_carries_its_attempts_and_when_the_first_failed() -> None:
    moments = iter(datetime(2026, 12, 8, 10, 0, second, tzinfo=UTC) for second in range(60))
    failures = Failures(max_attempts=3, delivery_timeout_ms=1000, now=lambda: next(moments))
    row, other = _row(), _row()
    own = Failure(row, KafkaError(KafkaError.INVALID_RECORD), own=True)
    failures.judge(0, Failure(other, KafkaError(KafkaError.INVALID_RECORD), own=True))
    failures.judge(0, own)
    failures.judge(0, own)
    verdict = failures.judge(0, own)
    assert verdict.dead_letter is not None
    assert (verdict.attempts, verdict.first_failed_at) == (
        3,
        datetime(2026, 12, 8, 10, 0, 1, tzinfo=UTC),
    ), "the row's own first failure, not another row's"
    failures.dead(row.id)
    again = [failures.judge(0, own) for _ in range(3)][-1]
    assert (again.attempts, again.first_failed_at) == (
        3,
        datetime(2026, 12, 8, 10, 0, 4, tzinfo=UTC),
    ), "a requeued row counts afresh"
    failures.dead(row.id)
    assert failures.judge(0, own).dead_letter is None  # its count started over


def test_overdue_pages_replay_only_when_their_topic_is_gone() -> None:
    gone_row, kept_row = _row("gone"), _row("kept")
    gone = Page(0, END, InFlight(), produced=[gone_row])
    kept = Page(1, END, InFlight(), produced=[kept_row])
    watch = TopicWatch(
        probe=lambda topic: TopicState.MISSING if topic == "gone" else TopicState.EXISTS,
        backoff=Backoff(first=1.0, maximum=5.0),
    )
    plan = overdue([gone, kept], topics=watch, timeout_ms=1000)
    assert plan.replay == {0} and plan.waiting == [kept]
