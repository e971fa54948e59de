"""What delivery reports lead to: acknowledged pages' progress recorded (fenced by each shard's
lease epoch), failed or overdue shards replayed from their recorded progress, rows that fail for
good dead-lettered, and shards given back or forgotten.

The parts decide (:mod:`~oncely.relay.settle`, :mod:`~oncely.relay.failures`,
:mod:`~oncely.relay.progress`); :class:`Outcomes` applies their decisions to the shard table,
the parked keys and the meters, and writes through the loop's database guard. A database
failure while recording replays every shard (duplicates, never loss).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable

from oncely.failpoints import failpoint
from oncely.relay import failures, settle
from oncely.relay.failures import Failures, Verdict
from oncely.relay.meters import Meters
from oncely.relay.pace import Pace
from oncely.relay.parking import ParkedKeys
from oncely.relay.ports import FAILED, Guard, Sources
from oncely.relay.progress import Acknowledged, quiet, refused
from oncely.relay.release import ReleaseOutcome
from oncely.relay.shards import Failure, Page, Shard, ShardTable
from oncely.relay.topics import TopicWatch, topic_error_state
from oncely.settings import RelaySettings
from oncely.storage.stores.outbox.relay import Held, Parking, ShardProgress
from oncely.storage.stores.outbox.rows import OutboxRow

log = logging.getLogger(__name__)


class Outcomes:
    """Applies what the broker answered to the relay's state; the loop calls :meth:`settle`
    every turn. Holds neither the store nor the publisher: each call that needs them gets the
    loop's :class:`~oncely.relay.ports.Sources`, and calls the database through its guard."""

    def __init__(
        self,
        *,
        settings: RelaySettings,
        topics: TopicWatch,
        shards: ShardTable,
        parked: ParkedKeys,
        meters: Meters,
        pace: Pace,
        db: Guard,
        clock: Callable[[], float],
    ) -> None:
        self._topics, self._settings = topics, settings
        self._shards, self._parked, self._meters, self._pace = shards, parked, meters, pace
        self._db, self._clock = db, clock
        self.failures = Failures(
            max_attempts=self._settings.max_attempts,
            delivery_timeout_ms=self._settings.delivery_timeout_ms,
        )
        #: Progress acknowledged and not yet recorded.
        self.acknowledged = Acknowledged()

    def lose(self, io: Sources, number: int) -> None:
        """The publisher cannot go on for a shard (exactly-once mode: its producer was fenced,
        failed, or could not end a transaction): give it back without recording anything. Its
        next owner's producer settles the open transaction, and starts where it ended."""
        shard = self._shards.get(number)
        if shard is None:
            io.publisher.drop(number)
            return
        self._meters.lost(number)
        epoch = shard.epoch
        self.forget(io, number)
        self._db("give back", lambda: io.store.release([(number, epoch)]))

    def forget(self, io: Sources, number: int) -> None:
        """Drop a shard without recording anything (it was lost, or has been given back)."""
        io.publisher.drop(number)
        self._shards.drop(number)
        self.acknowledged.drop(number)
        self._parked.drop_shard(number)
        self._meters.forget(number)

    def hand_off(self, io: Sources) -> None:
        """Give back shards over the fair share once everything read from them is recorded."""
        ready = self._shards.ready_to_hand_off()
        if not ready:
            return
        self.record_quiet(io, ready)
        released = self._db(
            "hand-off", lambda: io.store.release([(s.shard, s.epoch) for s in ready])
        )
        if released is FAILED:
            return
        for shard in ready:
            self.forget(io, shard.shard)
        if released:
            log.info("handed off shards %s", sorted(released))
            self._meters.handed_off(released)

    def settle(self, io: Sources) -> None:
        """Record acknowledged pages; replay the shards whose delivery failed or is overdue."""
        for row, error in settle.take_errors(self._shards):
            self._meters.produce_error(row.topic, row.shard, error.name())
            state = topic_error_state(error)
            if state is not None:
                self._topics.block(row.topic, state)
        if self._settings.exactly_once:  # before the lost shards are forgotten
            self._meters.transactions(io.publisher.ended())
        for number in io.publisher.lost():
            self.lose(io, number)
        if io.publisher.fatal is not None:
            log.warning("fatal producer error, recreating the producer and replaying")
            self._recreate(io, "fatal")
            return
        now = self._clock()
        settled = settle.settle(self._shards, now)
        for page in settled.acknowledged:
            if page.produced:
                io.publisher.reachable()
                self._meters.acknowledged(page)
                self.failures.published(page.produced)
        for progress in settled.progress:
            self.acknowledged.add(progress)
            if self._settings.exactly_once:
                self._shards.committed(progress)
        failed: dict[int, Failure | None] = dict(settled.failed)
        if settled.overdue:
            failed.update(self._overdue(io, settled.overdue, now))
        self._meters.flush()
        if self.acknowledged.due(self._clock(), urgent=bool(settled.parked or settled.held)):
            self.record_acknowledged(io, list(settled.parked.values()), settled.held)
        if failed:
            self._replay(io, failed)
        self.hand_off(io)

    def _overdue(self, io: Sources, pages: list[Page], now: float) -> dict[int, Failure | None]:
        """The shards whose oldest page is unconfirmed past ``delivery_timeout_ms`` and replay
        (``None``: no failure report): with every broker down all of them (the producer is then
        recreated), else as :func:`oncely.relay.failures.overdue` says; the others wait on."""
        for page in pages:
            topic = page.produced[0].topic if page.produced else ""
            self._meters.produce_error(topic, page.shard, "_MSG_TIMED_OUT")
        if io.publisher.brokers_down:
            return dict.fromkeys(page.shard for page in pages)
        timeout_ms = self._settings.delivery_timeout_ms
        plan = failures.overdue(pages, topics=self._topics, timeout_ms=timeout_ms)
        for page in plan.waiting:
            page.deadline = now + timeout_ms / 1000
        return dict.fromkeys(plan.replay)

    def _replay(self, io: Sources, failed: dict[int, Failure | None]) -> None:
        """Replay the failed shards from their recorded progress (:mod:`oncely.relay.failures`
        judges each); no other shard is touched. With every broker down past the delivery
        timeout, the producer cannot go on: it is recreated and every shard replays."""
        if any(failure is None for failure in failed.values()) and io.publisher.brokers_down:
            log.warning(
                "delivery timed out after %d ms with every broker down, recreating the producer",
                self._settings.delivery_timeout_ms,
            )
            self._recreate(io, "brokers_down")
            return
        backoff = {shard: self._judge(io, shard, failure) for shard, failure in failed.items()}
        if self.acknowledged:
            self.record_acknowledged(io)  # replay only what was not acknowledged
        now = self._clock()
        for number, delayed in backoff.items():
            shard = self._shards.get(number)
            if shard is not None:
                self.reset(shard, backoff=delayed, now=now)

    def _judge(self, io: Sources, shard: int, failure: Failure | None) -> bool:
        """Apply the verdict on a shard's failure; whether its replay waits (backoff)."""
        verdict = self.failures.judge(shard, failure)
        if failure is not None and verdict.forget_limits:
            io.publisher.forget_limits(failure.row.topic)
        if failure is not None and verdict.dead_letter is not None:
            self._dead_letter(io, failure.row, verdict)
        return verdict.backoff

    def _recreate(self, io: Sources, reason: str) -> None:
        """The producer cannot go on: record what is acknowledged, start a new producer (every
        outstanding record fails) and replay every shard from its recorded progress."""
        self._meters.recreated(reason)
        if self.acknowledged:
            self.record_acknowledged(io)
        io.publisher.recreate()
        self.reset_all()

    def reset_all(self) -> None:
        """Replay every shard from its recorded progress, after a backoff."""
        now = self._clock()
        for shard in list(self._shards):
            self.reset(shard, backoff=True, now=now)

    def reset(self, shard: Shard, *, backoff: bool, now: float) -> None:
        """Drop what ``shard`` has in flight and read it again from its recorded progress
        (after a backoff); keys its dropped pages parked are not parked any more."""
        self._pace.ask()
        self._meters.replayed(shard.shard)
        self.acknowledged.drop(shard.shard)
        self._parked.drop_pages(self._shards.reset(shard, backoff=backoff, now=now))

    def _dead_letter(self, io: Sources, row: OutboxRow, verdict: Verdict) -> None:
        error = verdict.dead_letter
        parking = Parking(
            row.topic,
            row.aggregateid,
            row.shard,
            row.id,
            "dead",
            error=error,
            attempts=verdict.attempts,
            first_failed_at=verdict.first_failed_at,
        )
        epoch = self._shards.epoch_of(row.shard)
        if self._db("dead letter", lambda: io.store.park([(parking, epoch)])) is FAILED:
            return
        self._parked.park(parking)
        self.failures.dead(row.id)
        self._meters.dead(row.topic)
        log.error(
            "row dead-lettered, its key is parked: %s",
            error,
            extra={"id": str(row.id), "topic": row.topic, "key": row.aggregateid},
        )

    def record_acknowledged(
        self,
        io: Sources,
        parked: list[tuple[Parking, int]] | None = None,
        held: list[Held] | None = None,
    ) -> None:
        """Record the progress of the acknowledged pages not yet recorded (with the keys they
        parked and the rows they held)."""
        failpoint("relay.after_ack_before_record")
        self._record(io, self.acknowledged.take(self._clock()), parked or [], held or [])

    def record_quiet(self, io: Sources, shards: Iterable[Shard]) -> None:
        """Record the position of ``shards`` whose last reads found nothing to publish."""
        positions = quiet(shards)
        if positions:
            self._record(io, positions, [], [])

    def _record(
        self,
        io: Sources,
        progress: list[ShardProgress],
        parked: list[tuple[Parking, int]],
        held: list[Held],
    ) -> None:
        """Write progress; a shard taken over is forgotten and the rest written again. When the
        database fails, every shard replays from its recorded progress."""
        recorded = self._db("progress", lambda: io.store.record(progress, parked=parked, held=held))
        if recorded is not FAILED:
            split = refused(progress, parked, held, recorded=recorded)
            if split is not None:
                self._meters.refused(split.shards)
                log.warning("progress refused for shards %s: taken over", sorted(split.shards))
                for number in split.shards:
                    if number in self._shards:
                        self._meters.lost(number)  # found here before the next heartbeat
                        self.forget(io, number)
                progress = split.progress
                recorded = self._db(
                    "progress",
                    lambda: io.store.record(split.progress, parked=split.parked, held=split.held),
                )
        if recorded is FAILED:
            self.reset_all()
            return
        for item in progress:
            self.acknowledged.drop(item.shard)
            self._shards.recorded(item)
        self._meters.recorded(progress)

    def released(self, io: Sources, shard: Shard, outcome: ReleaseOutcome) -> None:
        """Apply a release of ``shard``'s parked keys: unpark each key whose rows all went out
        (fenced by the shard's epoch); a key whose rows failed stays parked (blocked, or dead
        when its own row failed for good), and the shard waits (backoff) before the next try."""
        for again in outcome.again:
            if again.block is not None:
                self._topics.block(*again.block)
            if again.dead is not None:
                park = functools.partial(io.store.park_failed, again.parking, error=again.dead)
                if self._db("dead letter", park) is FAILED:
                    return
                self._parked.dead(again.parking, again.dead)
        for unpark in outcome.unpark:
            failpoint("relay.after_release_before_unpark")
            self._meters.published_alone(unpark.rows)
            released = self._db(
                "release",
                functools.partial(
                    io.store.unpark,
                    unpark.parking,
                    epoch=shard.epoch,
                    published_to=unpark.published_to,
                ),
            )
            if released is FAILED:
                return
            io.publisher.unparked(shard.shard, unpark.parking.event_id)
            if released:
                self._parked.released(unpark.parking)
                self._meters.released(shard.shard)
                log.info(
                    "key released (%s): %d row(s) published",
                    unpark.parking.request or unpark.parking.reason,
                    len(unpark.rows),
                    extra={"topic": unpark.parking.topic, "key": unpark.parking.aggregateid},
                )
        if outcome.failed:
            self.reset(shard, backoff=True, now=self._clock())
