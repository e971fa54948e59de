"""What the pages' delivery reports settle (pure over the shards' pages)."""

from __future__ import annotations

import uuid

from confluent_kafka import KafkaError

from oncely.relay.settle import settle, take_errors
from oncely.relay.shards import Failure, InFlight, Page, Shard
from oncely.storage.stores.outbox.relay import Held, Parking, Progress, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot

P1, P2, P3 = (Progress(Snapshot(n, n, frozenset())) for n in (1, 2, 3))


def _row(seq: int, shard: int = 0) -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), seq, shard, "t", f"k{seq}", "e", b"x", (), 0)


class _Message:
    def __init__(self, row: OutboxRow) -> None:
        self._row = row

    def headers(self) -> list[tuple[str, bytes]]:
        return [("id", self._row.event_id.encode())]


def _page(shard: Shard, ends: Progress, *rows: OutboxRow, in_flight: InFlight) -> Page:
    page = Page(shard.shard, ends, in_flight, deadline=10.0)
    for row in rows:
        page.sent(row)
    shard.add(page)
    return page


def test_acknowledged_pages_at_the_front_move_progress_and_bring_their_parked_and_held() -> None:
    in_flight = InFlight()
    shard = Shard(0, 4, P1, P1, 100.0)
    first = _page(shard, P2, _row(1), in_flight=in_flight)
    second = _page(shard, P3, _row(2), in_flight=in_flight)
    parking = Parking("t", "a", 0, uuid.uuid4(), "delayed")
    held = Held(uuid.uuid4(), "t", "b", 0)
    second.parked.append(parking)
    second.held.append(held)
    second.report(None, None)  # the second page is acknowledged, the first not yet
    assert settle([shard], 0.0).progress == []
    first.report(None, None)
    settled = settle([shard], 0.0)
    assert settled.acknowledged == [first, second]
    assert settled.progress == [ShardProgress(0, 4, P3)]
    assert settled.parked == {("t", "a"): (parking, 4)} and settled.held == [held]
    assert not shard.pages and in_flight.count == 0


def test_a_failed_report_fails_the_page_with_its_own_row_and_overdue_pages_are_found() -> None:
    in_flight = InFlight()
    failing = Shard(0, 1, P1, P1, 100.0)
    slow = Shard(1, 1, P1, P1, 100.0)
    rows = [_row(1), _row(2), _row(3)]
    page = _page(failing, P2, *rows, in_flight=in_flight)
    late = _page(slow, P2, _row(4, shard=1), in_flight=in_flight)
    error = KafkaError(KafkaError.INVALID_RECORD)
    page.report(None, None)
    page.report(error, _Message(rows[1]))  # type: ignore[arg-type]
    assert take_errors([failing, slow]) == [(rows[1], error)]
    assert page.failure == Failure(rows[1], error, own=False)
    settled = settle([failing, slow], now=10.0)
    assert settled.failed == {0: page.failure}
    assert settled.overdue == [late]
    assert settle([slow], now=9.9).overdue == []
