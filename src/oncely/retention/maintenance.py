"""Retention of the partitioned outbox and receipts: the plan (partitions to create ahead,
each closed partition's verdict, each table's state) and its execution.

:func:`plan` reads the catalog, the relay's progress and the receipts partitions' marks in one
short transaction, ends it, and only then asks Kafka about the marked topics (no lock on
oncely's tables is held while Kafka answers); it changes nothing. :func:`run` takes the
advisory lock first (a run that finds another in progress does nothing, not even a plan),
gathers the same facts, marking each receipts partition that has become otherwise droppable
(one scan of it, then Kafka's high watermarks: see :mod:`.guard`), then creates the partitions
ahead and drops each partition the guard lets go, in a transaction of its own that first stops
writes into the partition (a SHARE lock: reads go on), gathers its facts again and drops it only
if the guard still agrees (the drop itself holds the table for a moment). An outbox partition's
rows of parked keys (dead, delayed or blocked, and those held behind them) are kept aside in
the drop's transaction, for the relay to publish at release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import psycopg
import sqlalchemy as sa

from oncely.durations import describe
from oncely.errors import ConfigurationError
from oncely.retention import guard
from oncely.retention.guard import KafkaAnswer, Mark, OutboxFacts, ReceiptsFacts, Verdict
from oncely.settings import RelaySettings, RetentionSettings
from oncely.storage import partitions
from oncely.storage.partitions import Partition, PartitionError
from oncely.storage.stores import marks
from oncely.storage.stores.outbox import kept

#: Kafka's watermarks of the asked topics (see :func:`.kafka.watermarks`).
AskKafka = Callable[[Iterable[str]], KafkaAnswer]


#: pg_advisory_lock key held by a retention run ("retain" in ASCII).
RUN_LOCK = 0x72657461696E


class NotPartitionedError(ConfigurationError):
    """The outbox and the receipts are not partitioned: there is no partition to keep."""


@dataclass(frozen=True)
class Policy:
    """How long partitions are kept at least, and how maintenance behaves: made by
    :func:`policy_of` from the settings, which hold the defaults.

    Attributes:
        outbox_horizon: an outbox partition stays until its range ended this long ago (the
            republish horizon: ``oncely replay --from-outbox`` reaches back this far).
        receipts_horizon: a receipts partition stays until its range ended this long ago
            (and until Kafka has deleted every record of its topics it held when the partition
            was marked); set it to at least the outbox horizon plus the topics' ``retention.ms``
            plus their ``segment.ms`` (Kafka deletes whole segments), after which a partition
            still retained counts as blocked.
        ahead: partitions created ahead of the current one, in steps.
        lock_timeout: seconds a drop or a creation waits for its locks before giving up
            until the next run (staging waits behind it that long at most).
        interval: how long runs are apart at most (the relay's purge interval, a Job's
            schedule): :func:`run` refuses to run when the partitions created ahead do not
            outlast it (:func:`check_ahead`); ``None``: not checked.
    """

    outbox_horizon: timedelta
    receipts_horizon: timedelta
    ahead: int
    lock_timeout: float
    interval: timedelta | None = None

    def horizon(self, table: str) -> timedelta:
        return self.outbox_horizon if table == "oncely_outbox" else self.receipts_horizon


def policy_of(
    settings: RetentionSettings,
    relay: RelaySettings,
    *,
    outbox_horizon: timedelta | None = None,
    receipts_horizon: timedelta | None = None,
    interval: timedelta | None = None,
) -> Policy:
    """The :class:`Policy` of ``settings``, the outbox's horizon being the relay's
    ``retention_seconds``; a horizon given here wins (a command-line option). ``interval``:
    how long runs are apart (see :class:`Policy`)."""
    return Policy(
        outbox_horizon=timedelta(seconds=relay.retention_seconds)
        if outbox_horizon is None
        else outbox_horizon,
        receipts_horizon=timedelta(seconds=settings.receipts_horizon_seconds)
        if receipts_horizon is None
        else receipts_horizon,
        ahead=settings.ahead,
        lock_timeout=settings.lock_timeout_seconds,
        interval=interval,
    )


def check_ahead(step: timedelta, policy: Policy) -> None:
    """Raise :class:`~oncely.errors.ConfigurationError` when the partitions a run creates
    ahead (``policy.ahead`` steps past the current one) may end before the next run
    (``policy.interval`` later): the rows of the gap would go to the default partition. Runs
    that come late (a Job's starting deadline) belong in the interval."""
    interval = policy.interval
    if interval is None or policy.ahead * step > interval:
        return
    needed = interval // step + 1
    raise ConfigurationError(
        f"ONCELY_RETENTION_AHEAD={policy.ahead} partitions of {describe(step)} "
        f"cover {_minutes(policy.ahead * step)}, not the {_minutes(interval)} between "
        "retention runs: set "
        f"ONCELY_RETENTION_AHEAD to {needed} or more, or run retention more often"
    )


def _minutes(span: timedelta) -> str:
    return f"{span.total_seconds() / 60:g} min"


@dataclass(frozen=True)
class TableState:
    """One partitioned table now.

    Attributes:
        partitions: its range partitions (the default one not counted).
        bytes: its size on disk, every partition's table, indexes and TOAST.
        oldest: the start of its oldest retained range partition.
        default_rows: how many rows its default partition holds (PostgreSQL's statistics, a
            few seconds behind).
        blocked_seconds: how long its oldest partition has been past its horizon and still
            retained (0 when none is).
    """

    table: str
    partitions: int
    bytes: int
    oldest: datetime | None
    default_rows: int
    blocked_seconds: float


@dataclass(frozen=True)
class Plan:
    """What a run would do now: ``create`` the partitions (table, start) ahead, and each
    closed partition's verdict, oldest first per table, with Kafka's answer it used."""

    step: timedelta
    now: datetime
    create: list[tuple[str, datetime]]
    verdicts: list[Verdict]
    tables: list[TableState]
    #: Kafka's answer about the marked topics (what a drop's check under its lock reuses).
    kafka: KafkaAnswer = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What a run did: the partitions created and dropped, the rows of the outbox's default
    partition deleted (``purged``: rows no range partition will take, see
    :func:`oncely.storage.partitions.purge_default`), and every partition kept with its
    reason (a refusal at drop time included: a lock not granted, a fact changed); ``errors``:
    one line per partition that could not be created now (tried again next run); ``busy``:
    another run was in progress on the database, so this one did nothing, not even a plan
    (``plan`` is ``None``; not an error: every relay runs retention on its timer, one at a
    time); ``lock_refused``: a drop did not get its lock in time."""

    plan: Plan | None
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    purged: int = 0
    kept: list[Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    busy: bool = False
    lock_refused: bool = False


def plan(engine: sa.Engine, policy: Policy, kafka: AskKafka) -> Plan:
    """The plan now; changes nothing. Each table's closed partitions are judged oldest first
    until one must stay; Kafka is asked only about the marked topics of receipts partitions
    every other check lets go, after the database's transaction has ended. A receipts partition
    not marked yet waits for a run to mark it.

    Raises:
        NotPartitionedError: the tables are not partitioned.
        oncely.retention.kafka.KafkaUnansweredError: Kafka did not answer.
    """
    return _plan(engine, policy, kafka, marking=False)


def _plan(engine: sa.Engine, policy: Policy, kafka: AskKafka, *, marking: bool) -> Plan:
    """The plan; with ``marking`` (a run holding the advisory lock), each receipts partition
    that became otherwise droppable is scanned and marked, and the mark of one whose events the
    outbox holds again is discarded."""
    with _connect(engine) as conn, conn.begin():
        step = partitions.step_of(conn)
        if step is None:
            raise _not_partitioned()
        now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        create: list[tuple[str, datetime]] = []
        verdicts: list[Verdict] = []
        tables: list[TableState] = []
        receipts: list[Partition] = []
        gathered: dict[str, ReceiptsFacts] = {}
        for table in partitions.PARTITION_KEYS:
            found = partitions.partitions(conn, table)
            names = {p.name for p in found}
            start = partitions.window_start(now, step)
            for n in range(policy.ahead + 1):
                moment = start + step * n
                if partitions.partition_name(table, moment) not in names:
                    create.append((table, moment))
            closed = [p for p in found if p.upper is not None and p.upper <= now]
            if table == "oncely_outbox":
                verdicts += guard.in_order(
                    closed,
                    lambda p: guard.outbox_reason(
                        p, outbox_facts(conn, p), now=now, horizon=policy.outbox_horizon
                    ),
                )
            else:
                receipts = closed
                gathered = _receipts_facts(conn, closed, policy, now, marking=marking)
            tables.append(_state(conn, table, found, policy, now))
    # The transaction has ended: no lock is held while Kafka answers.
    topics = {
        topic
        for facts in gathered.values()
        for topic in (
            {t for t, highs in facts.mark.highs.items() if highs is not None}
            if facts.mark is not None
            else {t for t, _ in facts.highest_offsets}
        )
    }
    answer = kafka(sorted(topics)) if topics else {}
    if marking:
        gathered = _mark(engine, gathered, answer)
    verdicts += guard.in_order(
        receipts,
        lambda p: (
            guard.receipts_reason(
                p,
                replace(gathered[p.name], kafka=answer),
                now=now,
                horizon=policy.receipts_horizon,
            )
            if p.name in gathered
            else guard.NOT_MARKED
        ),
    )
    return Plan(step, now, create, verdicts, tables, answer)


def _receipts_facts(
    conn: sa.Connection,
    closed: list[Partition],
    policy: Policy,
    now: datetime,
    *,
    marking: bool,
) -> dict[str, ReceiptsFacts]:
    """The database's facts of the closed receipts partitions, oldest first, up to the first one
    they refuse (every later one waits for it). A marked partition's receipted offsets are its
    mark's (no scan); an unmarked one is scanned only when ``marking``."""
    gathered: dict[str, ReceiptsFacts] = {}
    for partition in closed:
        facts = ReceiptsFacts(partitions.outbox_holds(conn, partition))
        mark = mark_of_rows(marks.marks_of(conn, partition.name))
        horizon = policy.receipts_horizon
        if guard.database_reason(partition, facts, now=now, horizon=horizon) is not None:
            if marking and facts.outbox_rows and mark is not None:
                marks.discard(conn, partition.name)  # taken again once the outbox lets go
            gathered[partition.name] = facts
            return gathered
        if mark is not None:
            gathered[partition.name] = replace(facts, mark=mark, highest_offsets=mark.receipted)
            continue
        if not marking:
            if partitions.has_receipts(conn, partition):
                return gathered  # waits for a run to mark it
            gathered[partition.name] = facts  # nothing receipted: nothing to mark
            continue
        found = partitions.receipted(conn, partition)
        facts = replace(facts, unplaced=found.unplaced, highest_offsets=found.highest)
        gathered[partition.name] = facts
        if facts.unplaced:
            return gathered
    return gathered


def _mark(
    engine: sa.Engine, gathered: dict[str, ReceiptsFacts], answer: KafkaAnswer
) -> dict[str, ReceiptsFacts]:
    """``gathered`` with a mark taken from ``answer`` for each unmarked partition whose receipts
    were scanned (recorded; not when Kafka did not answer about one of its topics)."""
    marked = dict(gathered)
    unmarked = {  # scanned, not marked, refused by nothing else (nothing receipted: no mark)
        name: facts
        for name, facts in gathered.items()
        if facts.mark is None
        and facts.highest_offsets
        and not facts.unplaced
        and not facts.outbox_rows
    }
    if not unmarked:
        return marked
    with _connect(engine) as conn, conn.begin():
        for name, facts in unmarked.items():
            mark = guard.mark_of(facts.highest_offsets, answer)
            if mark is None:
                unanswered = sorted({t for t, _ in facts.highest_offsets} - set(answer))
                marked[name] = replace(facts, unanswered=unanswered)
                continue
            marks.record(conn, name, rows_of_mark(mark))
            marked[name] = replace(facts, mark=mark)
    return marked


def mark_of_rows(rows: list[marks.MarkRow]) -> Mark | None:
    """The :class:`~.guard.Mark` the store's ``rows`` hold, ``None`` when there are none."""
    if not rows:
        return None
    highs: dict[str, dict[int, int] | None] = {}
    receipted: dict[tuple[str, int], int] = {}
    for row in rows:
        if row.partition == marks.ABSENT:
            highs[row.topic] = None
            continue
        topic_highs = highs.setdefault(row.topic, {})
        if topic_highs is not None:
            topic_highs[row.partition] = row.high
        if row.receipted is not None:
            receipted[(row.topic, row.partition)] = row.receipted
    return Mark(highs, receipted)


def rows_of_mark(mark: Mark) -> list[marks.MarkRow]:
    """The store's rows of ``mark``."""
    rows = []
    for topic, highs in sorted(mark.highs.items()):
        if highs is None:
            rows.append(marks.MarkRow(topic, marks.ABSENT, 0, None))
            continue
        for number, high in sorted(highs.items()):
            rows.append(marks.MarkRow(topic, number, high, mark.receipted.get((topic, number))))
    return rows


def states(engine: sa.Engine, policy: Policy) -> list[TableState]:
    """Each partitioned table's state now (what :func:`plan` reports, without judging a
    partition or asking Kafka): after a run, what it left.

    Raises:
        NotPartitionedError: the tables are not partitioned.
    """
    with _connect(engine) as conn:
        if partitions.step_of(conn) is None:
            raise _not_partitioned()
        now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
        return [
            _state(conn, table, partitions.partitions(conn, table), policy, now)
            for table in partitions.PARTITION_KEYS
        ]


def _not_partitioned() -> NotPartitionedError:
    return NotPartitionedError(
        "the outbox and the receipts are not partitioned: convert them with "
        "`oncely db upgrade --partition-every 1d`, or purge with `oncely relay purge` "
        "and `oncely receipts purge`"
    )


def _reason(
    conn: sa.Connection, partition: Partition, policy: Policy, now: datetime, answer: KafkaAnswer
) -> str | None:
    """Why ``partition`` must stay now, checked again under its lock with Kafka's ``answer``
    from the plan (at or below Kafka's watermarks now: conservative). A receipts partition is
    scanned again; its mark is discarded when the outbox holds its events again or a receipt
    is not covered by it (a later run marks it again)."""
    if partition.table == "oncely_outbox":
        return guard.outbox_reason(
            partition, outbox_facts(conn, partition), now=now, horizon=policy.outbox_horizon
        )
    found = partitions.receipted(conn, partition)
    mark = mark_of_rows(marks.marks_of(conn, partition.name))
    facts = ReceiptsFacts(
        partitions.outbox_holds(conn, partition), found.unplaced, found.highest, mark, answer
    )
    reason = guard.receipts_reason(partition, facts, now=now, horizon=policy.receipts_horizon)
    if mark is not None and (facts.outbox_rows or guard.uncovered(found.highest, mark) is not None):
        marks.discard(conn, partition.name)
    return reason


def outbox_facts(conn: sa.Connection, partition: Partition) -> OutboxFacts:
    """The outbox ``partition``'s facts: the shards whose progress has not passed all its rows.
    Its parked and held rows do not keep it: :func:`_drop` keeps them aside after reading this
    (:func:`oncely.storage.stores.outbox.kept.keep`)."""
    return OutboxFacts(partitions.unpassed_shards(conn, partition))


def _state(
    conn: sa.Connection, table: str, found: list[Partition], policy: Policy, now: datetime
) -> TableState:
    ranges = [p for p in found if p.lower is not None]
    oldest = ranges[0] if ranges else None
    blocked = 0.0
    if oldest is not None and oldest.upper is not None:
        blocked = max(0.0, (now - oldest.upper - policy.horizon(table)).total_seconds())
    return TableState(
        table,
        len(ranges),
        sum(p.bytes for p in found),
        oldest.lower if oldest else None,
        partitions.default_rows(conn, table),
        blocked,
    )


def run(engine: sa.Engine, policy: Policy, kafka: AskKafka, *, drop: bool = True) -> Outcome:
    """Delete the outbox's default rows no partition will take (passed by the relay, past the
    outbox horizon), execute :func:`plan`, marking the receipts partitions that became
    otherwise droppable: create the partitions ahead (moving their rows out of the default
    partitions), then drop those the guard lets go, oldest first, each under its lock after
    checking it again; return what was done. Without ``drop`` (a caller backing off after a
    drop's lock was not granted) nothing is dropped: the partitions ahead are still created.

    A partition that cannot be created (a lock not granted, any database error) is reported in
    ``errors`` and the rest of the run goes on. A partition whose lock is not granted within
    ``policy.lock_timeout`` (or whose facts changed) is kept and reported; later partitions of
    its table wait for it. One run at a time: a run that finds another one running (any
    process, this database) does nothing, not even a plan, and says so (``busy``). Creating
    and dropping partitions needs the tables' owner (the role that ran ``oncely db upgrade``).

    Raises:
        NotPartitionedError: the tables are not partitioned.
        oncely.errors.ConfigurationError: ``policy.ahead`` does not cover ``policy.interval``
            (:func:`check_ahead`); nothing was done.
        oncely.retention.kafka.KafkaUnansweredError: Kafka did not answer.
    """
    with engine.connect() as conn:
        step = partitions.step_of(conn)
    if step is None:
        raise _not_partitioned()
    check_ahead(step, policy)
    # The lock is the session's, held across the run's transactions; the session holds no
    # transaction open meanwhile (autocommit).
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as session:
        if not session.execute(
            sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": RUN_LOCK}
        ).scalar():
            return Outcome(None, busy=True)
        try:
            return _run(engine, policy, kafka, drop=drop)
        finally:
            session.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": RUN_LOCK})


def _run(engine: sa.Engine, policy: Policy, kafka: AskKafka, *, drop: bool) -> Outcome:
    purged = _purge_default(engine, policy)
    current = _plan(engine, policy, kafka, marking=True)
    outcome = Outcome(current, purged=purged)
    lock_refused = False
    for table, moment in current.create:
        try:
            with _connect(engine) as conn, conn.begin():
                _lock_timeout(conn, policy.lock_timeout)
                outcome.created.append(
                    partitions.create_partition(conn, table, moment, moment + current.step)
                )
        except sa.exc.DBAPIError as exc:  # one partition's error; the others go on
            name = partitions.partition_name(table, moment)
            if isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                outcome.errors.append(
                    f"{name}: not created, lock not granted in {policy.lock_timeout:g} s "
                    f"({type(exc.orig).__name__}); retried next run"
                )
            else:
                first = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
                outcome.errors.append(
                    f"{name}: not created ({type(exc.orig).__name__}: {first}); retried next run"
                )
    blocked: set[str] = set()
    for verdict in current.verdicts:
        table = verdict.partition.table
        if not drop or not verdict.droppable or table in blocked:
            kept = verdict.reason or (
                "waits for an older partition kept in this run"
                if drop
                else "not dropped in this run: it backs off after a lock not granted"
            )
            outcome.kept.append(Verdict(verdict.partition, kept))
            continue
        refused = _drop(engine, verdict.partition, policy, current.now, current.kafka)
        if refused is None:
            outcome.dropped.append(verdict.partition.name)
        else:
            blocked.add(table)
            lock_refused |= isinstance(refused, _LockNotGranted)
            outcome.kept.append(Verdict(verdict.partition, refused))
    return replace(outcome, lock_refused=lock_refused)


class _LockNotGranted(str):
    """A drop's refusal for want of a lock (the caller backs off: :attr:`Outcome.lock_refused`)."""

    __slots__ = ()


#: Rows of the outbox's default partition deleted per statement (each its own transaction).
_PURGE_BATCH = 1000


def _purge_default(engine: sa.Engine, policy: Policy) -> int:
    """Delete the outbox's default rows no range partition will take, that the relay has
    passed and that are past the outbox horizon, in batches; return how many."""
    purged = 0
    while True:
        with _connect(engine) as conn, conn.begin():
            now: datetime = conn.execute(sa.text("SELECT now()")).scalar_one()
            step = partitions.step_of(conn)
            if step is None:
                return purged
            batch = partitions.purge_default(
                conn,
                below=partitions.window_start(now, step),
                older_than=policy.outbox_horizon,
                limit=_PURGE_BATCH,
            )
        purged += batch
        if batch < _PURGE_BATCH:
            return purged


def _drop(
    engine: sa.Engine,
    partition: Partition,
    policy: Policy,
    now: datetime,
    answer: KafkaAnswer,
) -> str | None:
    """Drop ``partition`` if the guard, asked again under its lock, agrees; else the reason.
    A receipts partition's mark goes with it."""
    try:
        with _connect(engine) as conn, conn.begin():
            partitions.freeze(conn, partition, timeout=policy.lock_timeout)
            reason = _reason(conn, partition, policy, now, answer)
            if reason is not None:
                return reason
            if partition.table == "oncely_outbox":  # after the progress read, as kept.keep needs
                kept.keep(conn, *partition.ids())
            partitions.drop(conn, partition, timeout=policy.lock_timeout)
            if partition.table == "oncely_receipts":
                marks.discard(conn, partition.name)
    except PartitionError as exc:  # freeze's or drop's lock not granted
        return _LockNotGranted(exc)
    except sa.exc.OperationalError as exc:
        return _LockNotGranted(
            f"lock on {partition.table} not granted in {policy.lock_timeout:g} s "
            f"({type(exc.orig).__name__}); retried next run"
        )
    return None


def _connect(engine: sa.Engine) -> sa.Connection:
    """A connection of ``engine`` at READ COMMITTED, whatever the database's, the role's or
    the engine's default: the re-check under a partition's lock must see every transaction
    that committed while the lock was awaited, which a snapshot taken earlier (REPEATABLE
    READ, SERIALIZABLE) would not."""
    return engine.connect().execution_options(isolation_level="READ COMMITTED")


def _lock_timeout(conn: sa.Connection, seconds: float) -> None:
    conn.execute(
        sa.text("SELECT set_config('lock_timeout', :ms, true)"), {"ms": f"{seconds * 1000:.0f}ms"}
    )
