"""Publishing the rows of released keys: each key's dead, delayed or blocked row first (unless
skipped), then the rows held behind it, in order, waiting for every report before the key is
unparked. Gets the store and the publisher as arguments and returns a :class:`ReleaseOutcome`;
the loop unparks, parks again and backs off as it says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from uuid import UUID

from confluent_kafka import KafkaError, Message

from oncely.relay import delivery
from oncely.relay.ports import Publisher, RelayStore
from oncely.relay.topics import TopicState, topic_error_state
from oncely.storage.stores.outbox.relay import Parking, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow

Results = list[tuple[OutboxRow, KafkaError | None]]


@dataclass(frozen=True, slots=True)
class Unpark:
    """A key whose rows all went out: unpark it and drop its held rows up to ``published_to``
    (``rows``: those this release published; none when a committed transaction had already
    published them, :meth:`~oncely.relay.ports.Publisher.released`)."""

    parking: Parking
    rows: list[OutboxRow]
    published_to: int | None


@dataclass(frozen=True, slots=True)
class ParkAgain:
    """A key whose rows did not all go out stays parked: ``block`` its topic (missing or not
    authorised), and park it as ``dead`` with that error when its own row failed for good."""

    parking: Parking
    block: tuple[str, TopicState] | None = None
    dead: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    """What a release did; ``failed``: some row did not go out, the shard waits (backoff)."""

    unpark: list[Unpark]
    again: list[ParkAgain]
    failed: bool


def release(
    store: RelayStore,
    publisher: Publisher,
    parkings: Sequence[Parking],
    *,
    position: ShardProgress,
    timeout: float,
    clock: Callable[[], float],
) -> ReleaseOutcome:
    """Publish the rows of ``parkings`` (of the shard at ``position``) and wait at most
    ``timeout`` seconds for their reports; in exactly-once mode they are one transaction,
    committed with ``position`` and the parkings released when every row went out, else
    aborted. A parking a committed transaction released already is unparked, not published
    again.

    Raises ``sqlalchemy.exc.DBAPIError`` when the rows cannot be read (nothing is published).
    """
    batch: list[tuple[Parking, list[tuple[int, UUID]], list[OutboxRow]]] = []
    settled: list[Unpark] = []
    already = publisher.released(position.shard)
    for parking in parkings:
        held = store.held_of(parking.key)
        if parking.event_id in already:
            settled.append(Unpark(parking, [], held[-1][0] if held else None))
            continue
        # A row is held twice when the page that held it aborted and was read again (its
        # held rows are written before the commit, in exactly-once mode): it goes out once.
        ids = list(dict.fromkeys(event_id for _, event_id in held))
        if parking.request != "skip":
            ids.insert(0, parking.event_id)
        found = store.rows(ids)
        batch.append((parking, held, [found[i] for i in ids if i in found]))
    results, complete = publish_alone(
        publisher, [row for _, _, rows in batch for row in rows], timeout=timeout, clock=clock
    )
    errors = {row.id: error for row, error in results if error is not None}
    acked = {row.id for row, error in results if error is None}
    unpark: list[Unpark] = []
    again: list[ParkAgain] = []
    for parking, held, rows in batch:
        if all(row.id in acked for row in rows):
            unpark.append(Unpark(parking, rows, held[-1][0] if held else None))
            continue
        failures = [(row, errors[row.id]) for row in rows if row.id in errors]
        if failures:
            again.append(park_again(parking, *failures[0]))
    failed = not complete or bool(errors)
    releasing = [u.parking.event_id for u in unpark]
    if not _ended(publisher, position, releasing, failed=failed, timeout=timeout):
        return ReleaseOutcome(settled, again, failed=True)
    return ReleaseOutcome(settled + unpark, again, failed=failed)


def _ended(
    publisher: Publisher,
    position: ShardProgress,
    releasing: list[UUID],
    *,
    failed: bool,
    timeout: float,
) -> bool:
    """End the release's transaction (exactly-once mode), which releases ``releasing``:
    committed when nothing ``failed``, else aborted; whether its rows are published. At least
    once there is none: they are, as their reports said."""
    ended: list[KafkaError | None] = []

    def report(error: KafkaError | None, message: Message | None) -> None:
        ended.append(error)

    if not publisher.commit(position, report, abort=failed, releasing=releasing):
        return True
    publisher.flush(timeout)
    return not failed and ended == [None]


def park_again(parking: Parking, row: OutboxRow, error: KafkaError) -> ParkAgain:
    """A released key's first failed row ``row``: its topic missing blocks the topic (the key
    stays blocked); a permanent failure of the key's own row makes the key dead."""
    state = topic_error_state(error)
    block = (row.topic, state) if state is not None else None
    if block is not None and parking.reason == "blocked":
        return ParkAgain(parking, block=block)
    if row.id != parking.event_id or delivery.is_transient(error):
        return ParkAgain(parking, block=block)
    return ParkAgain(parking, block=block, dead=delivery.error_text(error))


def publish_alone(
    publisher: Publisher, rows: list[OutboxRow], *, timeout: float, clock: Callable[[], float]
) -> tuple[Results, bool]:
    """Produce ``rows`` and wait for their reports; return them, and whether all came."""
    results: Results = []
    for row in rows:
        refused = publisher.produce(row, _collect(row, results))
        if refused is not None:
            results.append((row, refused))
    deadline = clock() + timeout
    while len(results) < len(rows) and clock() < deadline:
        publisher.poll(0.05)
    return results, len(results) == len(rows)


def _collect(
    row: OutboxRow, results: Results
) -> Callable[[KafkaError | None, Message | None], None]:
    def report(error: KafkaError | None, message: Message | None) -> None:
        results.append((row, error))

    return report
