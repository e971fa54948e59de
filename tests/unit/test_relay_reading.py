"""One read of a group of shards: where it ends and the pages it produces (publisher fake)."""

from __future__ import annotations

import uuid

from confluent_kafka import KafkaError

from oncely.relay.reading import cut, produce
from oncely.relay.shards import InFlight, Page, Shard
from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.rows import OutboxRow
from oncely.storage.stores.outbox.snapshots import Snapshot
from tests.unit.relay_fakes import Clock, FakePublisher

DONE = Snapshot(1, 1, frozenset())
READING = Snapshot(9, 9, frozenset())
CURSOR = Progress(DONE)


def _row(seq: int, shard: int) -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), seq, shard, "t", f"k{seq}", "e", b"x", (), 0)


def _shards() -> list[Shard]:
    return [Shard(n, 1, CURSOR, CURSOR, 100.0) for n in (0, 1)]


def test_a_suspect_first_goes_out_alone_and_the_other_shards_move_past_it() -> None:
    rows = [_row(1, 0), _row(2, 1)]
    members = _shards()
    read = cut(
        rows,
        cursor=CURSOR,
        reading=READING,
        page_size=10,
        members=members,
        waits=lambda row: False,
        suspects={rows[0].id},
        limit_of=lambda topic: None,
    )
    assert read is not None and read.isolated and read.rows == [rows[0]]
    assert read.members == [members[0]]
    assert members[1].cursor == read.ends == Progress(DONE, READING, 1)


def test_pages_per_shard_a_refused_row_fails_only_its_shards_page() -> None:
    rows = [_row(1, 0), _row(2, 1), _row(3, 0), _row(4, 1)]
    read = cut(
        rows,
        cursor=CURSOR,
        reading=READING,
        page_size=10,
        members=_shards(),
        waits=lambda row: False,
        suspects=set(),
        limit_of=lambda topic: None,
    )
    assert read is not None
    publisher = FakePublisher(Clock())
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)

    def send(row: OutboxRow, report: object) -> KafkaError | None:
        return too_large if row is rows[0] else publisher.produce(row, report)  # type: ignore[arg-type]

    held: list[OutboxRow] = []

    def waits(row: OutboxRow, page: Page) -> bool:
        if row is rows[3]:
            held.append(row)
            return True
        return False

    in_flight = InFlight()
    pages, refused = produce(read, in_flight=in_flight, deadline=5.0, send=send, waits=waits)
    assert refused == [(rows[0], too_large)]
    assert pages[0].failure is not None and pages[0].produced == []  # row 3 was not produced
    assert pages[1].produced == [rows[1]] and held == [rows[3]]
    assert in_flight.count == 1 and pages[1].deadline == 5.0
