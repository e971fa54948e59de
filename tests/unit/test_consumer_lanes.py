"""Per-key lanes: which lane a record goes to, and which offset a partition may commit."""

from __future__ import annotations

import uuid
import zlib

from confluent_kafka import Message

from oncely.consumers.apply import BatchResult, Failure
from oncely.consumers.lanes import lane_of, merge_results, split_lanes
from oncely.consumers.records import Undecodable


def _record(partition: int, offset: int, key: bytes | None) -> Undecodable:
    message = Message(topic="t", partition=partition, offset=offset, key=key, value=b"")
    return Undecodable(message, "")


def _failure(partition: int, offset: int, kind: str = "handler") -> Failure:
    message = Message(topic="t", partition=partition, offset=offset)
    return Failure(message, "boom", kind)  # type: ignore[arg-type]


def test_a_key_always_lands_on_the_same_lane_in_batch_order() -> None:
    keys = [f"k{i}".encode() for i in range(50)]
    records = [_record(0, offset, keys[offset % 50]) for offset in range(1000)]
    runs = split_lanes(records, 4)
    assert len(runs) == 4, "50 keys spread over every lane"
    lane_of: dict[bytes | None, int] = {}
    for lane, run in enumerate(runs):
        offsets = [r.message.offset() for r in run]
        assert offsets == sorted(offsets), "a lane keeps the batch's order"
        for record in run:
            assert lane_of.setdefault(record.message.key(), lane) == lane
    again = split_lanes(list(reversed(records)), 4)
    assert {r.message.key(): i for i, run in enumerate(again) for r in run} == lane_of


def test_a_partition_s_keys_spread_over_every_lane_under_librdkafka_s_crc32_partitioner() -> None:
    # librdkafka's default partitioner puts a key on crc32(key) % partitions: with 6 partitions
    # and 8 lanes, crc32(key) % 8 would give each partition's keys only 4 of the 8 lanes.
    keys = [f"acc-{k}".encode() for k in range(1000)]
    for partition in range(6):
        mine = [key for key in keys if zlib.crc32(key) % 6 == partition]
        assert {lane_of(key, 8) for key in mine} == set(range(8))
    per_lane = [sum(1 for key in keys if lane_of(key, 8) == lane) for lane in range(8)]
    assert max(per_lane) - min(per_lane) < 30, per_lane


def test_keyless_records_go_by_partition() -> None:
    records = [_record(p, o, None) for p in range(3) for o in range(5)]
    for run in split_lanes(records, 8):
        assert len({r.message.partition() for r in run}) == 1


def test_one_lane_takes_the_whole_batch_in_order() -> None:
    records = [_record(o % 3, o, str(uuid.uuid4()).encode()) for o in range(20)]
    assert split_lanes(records, 1) == [records]


def test_a_partition_commits_after_its_last_record_when_every_lane_finished() -> None:
    outcomes = [BatchResult(done={("t", 0): 8, ("t", 1): 3}), BatchResult(done={("t", 0): 10})]
    assert merge_results(outcomes) == ({("t", 0): 10, ("t", 1): 3}, [])


def test_a_partition_commits_only_below_its_lowest_unfinished_record() -> None:
    lowest = _failure(0, 5)
    outcomes = [
        BatchResult(done={("t", 0): 10}),  # keys after the failure went on in their lane
        BatchResult(done={("t", 0): 4}, failures=[lowest]),
        BatchResult(done={("t", 0): 7, ("t", 1): 2}, failures=[_failure(0, 8, "database")]),
    ]
    offsets, stops = merge_results(outcomes)
    assert offsets == {("t", 0): 5, ("t", 1): 2}
    assert stops == [lowest], "the policy acts on the lowest failed record only"


def test_a_database_failure_of_a_lane_holds_its_first_record() -> None:
    failed = _failure(2, 40, "database")
    offsets, stops = merge_results(
        [BatchResult(done={("t", 2): 60}), BatchResult(failures=[failed])]
    )
    assert offsets == {("t", 2): 40}
    assert stops == [failed]
