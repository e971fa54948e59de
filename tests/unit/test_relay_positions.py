"""A shard's positions in order (pure), and the progress record that carries one to Kafka."""

from __future__ import annotations

import itertools

import pytest

from oncely.storage.stores.outbox.relay import Progress
from oncely.storage.stores.outbox.snapshots import Snapshot
from oncely.wire import ProgressRecord, read_progress_record


def snap(text: str) -> Snapshot:
    return Snapshot.parse(text)


def test_later_snapshots_order_after_earlier_ones() -> None:
    # 100 and 102 running; then 100 ends; then 103 starts and 102 ends; then 103 ends.
    taken = [snap("100:103:100,102"), snap("102:103:102"), snap("103:104:103"), snap("104:104:")]
    assert [s.order() for s in taken] == sorted(s.order() for s in taken)
    assert len({s.order() for s in taken}) == len(taken)


def test_a_shard_moves_from_done_through_reading_to_done_at_reading() -> None:
    done, reading = snap("100:103:100,102"), snap("103:110:")
    path = [
        Progress(done),
        Progress(done, reading, 5),
        Progress(done, reading, 9),
        Progress(reading),
        Progress(snap("110:112:111"), snap("112:115:"), 1),
    ]
    for earlier, later in itertools.pairwise(path):
        assert later.beyond(earlier)
        assert not earlier.beyond(later)
    assert not path[2].beyond(path[2])


def test_a_progress_record_reads_back_as_written() -> None:
    record = ProgressRecord(3, 7, "100:103:100,102", "103:110:", 42)
    assert record.key() == b"3"
    assert read_progress_record(record.value()) == record
    assert read_progress_record(ProgressRecord(0, 1, "5:5:").value()).reading is None


@pytest.mark.parametrize(
    ("value", "says"),
    [(b"not json", "Invalid JSON"), (b'{"shard": 1}', "Field required"), (b"[]", "")],
)
def test_what_is_not_a_progress_record_is_refused_in_one_line(value: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=f"not an oncely progress record: .*{says}") as info:
        read_progress_record(value)
    assert "\n" not in str(info.value)
