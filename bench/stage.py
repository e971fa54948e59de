"""R5: the cost of ``stage()`` — a business transaction with one staged event / without.

Three shapes of business transaction, each measured with and without ``stage()`` (Avro, one
event per transaction), all sides interleaved in one run after a warm-up:

- **one statement**: insert one row into ``transfers``, commit (target >= 0.8);
- **five statements**: insert the transfer, update two account balances, insert two ledger
  lines, commit (target >= 0.9);
- **8 concurrent writers**: the one-statement transaction from 8 threads, each with its own
  connection (target >= 0.85). This is where a NOTIFY per commit would show: PostgreSQL
  serialises committing transactions that notify. Staging notifies only while a relay sleeps;
  a context cell runs the same 8 writers with a relay marked asleep (a NOTIFY at every commit)
  / with none asleep.

Each block commits ``transactions`` transactions on an emptied outbox; the rate is tx/s.
Events are built before the timed loop.

Two cells compare ``stage()`` with the least a client can do for the same outbox rows, psycopg
alone (:func:`measure_client`):

- **S-CPU**: client CPU per event (this thread's CPU time around the call) of ``stage()`` on a
  ``Session`` / of a raw psycopg ``INSERT`` of the same row, encoded beforehand (target <= 1.5);
- **S-MANY**: events/s of transactions of ``stage_many()`` of 100 events / of one raw
  multi-row ``INSERT`` of the same 100 rows, commit included (target >= 0.8).

``python -m bench R5 S-CPU S-MANY`` runs them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal

import psycopg
import sqlalchemy as sa
from examples.payments.events import TransferCompleted, registry
from psycopg.types.json import Jsonb
from sqlalchemy.orm import Session

from bench.harness import Cell, cpu_window, interleave
from oncely.ids import uuid7
from oncely.producer.staging import stage, stage_many
from oncely.schemas.codec import Codec
from oncely.storage import upgrade

WRITERS = 8
ONE, FIVE, MANY, NOTIFY = (
    "one statement",
    "five statements",
    f"{WRITERS} concurrent writers",
    f"{WRITERS} concurrent writers, a relay asleep (NOTIFY at each commit)",
)


def _events(n: int) -> list[TransferCompleted]:
    now = datetime.now(UTC)
    return [
        TransferCompleted(
            transfer_id=uuid.uuid4(),
            amount=Decimal("10.00"),
            currency="EUR",
            from_account="acc-1",
            to_account="acc-2",
            completed_at=now,
        )
        for _ in range(n)
    ]


_INSERT = sa.text("INSERT INTO transfers (id, amount) VALUES (:id, :amount)")
_DEBIT = sa.text("UPDATE accounts SET balance = balance - :amount WHERE id = :account")
_CREDIT = sa.text("UPDATE accounts SET balance = balance + :amount WHERE id = :account")
_LINE = sa.text("INSERT INTO ledger (transfer_id, account, amount) VALUES (:id, :account, :amount)")


def _one(session: Session, event: TransferCompleted) -> None:
    session.execute(_INSERT, {"id": event.transfer_id, "amount": event.amount})


def _five(session: Session, event: TransferCompleted) -> None:
    session.execute(_INSERT, {"id": event.transfer_id, "amount": event.amount})
    session.execute(_DEBIT, {"amount": event.amount, "account": event.from_account})
    session.execute(_CREDIT, {"amount": event.amount, "account": event.to_account})
    for account, amount in ((event.from_account, -event.amount), (event.to_account, event.amount)):
        session.execute(_LINE, {"id": event.transfer_id, "account": account, "amount": amount})


def _reset(engine: sa.Engine, tables: str = "oncely_outbox, transfers, ledger") -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables}"))


def _block(
    engine: sa.Engine,
    events: list[TransferCompleted],
    business: Callable[[Session, TransferCompleted], None],
    *,
    with_stage: bool,
    writers: int = 1,
) -> float:
    """Commit one transaction per event from ``writers`` threads; return transactions/s."""
    _reset(engine)
    shares = [events[i::writers] for i in range(writers)]
    ready = threading.Barrier(writers + 1)

    def write(share: list[TransferCompleted]) -> None:
        with Session(engine) as session:
            session.execute(sa.text("SELECT 1"))
            session.commit()
            ready.wait()
            for event in share:
                with session.begin():
                    business(session, event)
                    if with_stage:
                        stage(session, event)

    threads = [threading.Thread(target=write, args=(share,)) for share in shares]
    for thread in threads:
        thread.start()
    with cpu_window():
        ready.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    return len(events) / elapsed


@contextlib.contextmanager
def _relay_asleep(engine: sa.Engine) -> Iterator[None]:
    """A relay member marked asleep for the block: staging NOTIFYs at every commit."""
    relay_id = f"bench-asleep-{uuid.uuid4().hex[:6]}"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_members (relay_id, heartbeat_until, asleep)"
                " VALUES (:r, now() + interval '1 hour', true)"
            ),
            {"r": relay_id},
        )
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(
                sa.text("DELETE FROM oncely_relay_members WHERE relay_id = :r"), {"r": relay_id}
            )


def create_business_tables(engine: sa.Engine) -> None:
    """R5's business tables (``transfers``, ``accounts``, ``ledger``), dropped and created."""
    with engine.begin() as conn:
        for table in ("transfers", "accounts", "ledger"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(sa.text("CREATE TABLE transfers (id uuid PRIMARY KEY, amount numeric)"))
        conn.execute(sa.text("CREATE TABLE accounts (id text PRIMARY KEY, balance numeric)"))
        conn.execute(
            sa.text(
                "CREATE TABLE ledger (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                " transfer_id uuid NOT NULL, account text NOT NULL, amount numeric NOT NULL)"
            )
        )
        conn.execute(sa.text("INSERT INTO accounts VALUES ('acc-1', 0), ('acc-2', 0)"))


def one_statement_block(engine: sa.Engine, transactions: int, *, writers: int = 1) -> float:
    """Transactions/s of R5's one-statement transaction + ``stage()`` on an emptied outbox,
    from ``writers`` threads (the R5 side, for another cell's database)."""
    return _block(engine, _events(transactions), _one, with_stage=True, writers=writers)


def measure(database_url: str, *, transactions: int, repetitions: int) -> list[Cell]:
    """The R5 cells (one statement, five statements, 8 writers) and the NOTIFY context cell."""
    engine = sa.create_engine(database_url, pool_size=WRITERS + 2)
    upgrade(engine)
    create_business_tables(engine)
    with engine.begin() as conn:
        synchronous_commit = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
        asleep = conn.execute(
            sa.text("SELECT count(*) FROM oncely_relay_members WHERE asleep")
        ).scalar_one()
    if asleep:
        raise RuntimeError(f"{asleep} relay(s) asleep on this database: stop them before R5")

    def side(
        business: Callable[[Session, TransferCompleted], None],
        *,
        with_stage: bool,
        writers: int = 1,
        notify: bool = False,
    ) -> Callable[[], float]:
        def run() -> float:
            events = _events(transactions)
            with _relay_asleep(engine) if notify else contextlib.nullcontext():
                return _block(engine, events, business, with_stage=with_stage, writers=writers)

        return run

    sides = {
        f"{ONE} + stage()": side(_one, with_stage=True),
        f"{ONE} alone": side(_one, with_stage=False),
        f"{FIVE} + stage()": side(_five, with_stage=True),
        f"{FIVE} alone": side(_five, with_stage=False),
        f"{MANY} + stage()": side(_one, with_stage=True, writers=WRITERS),
        f"{MANY} alone": side(_one, with_stage=False, writers=WRITERS),
        f"{NOTIFY} + stage()": side(_one, with_stage=True, writers=WRITERS, notify=True),
    }
    try:
        run = interleave(sides, repetitions=repetitions)
    finally:
        _reset(engine)
        engine.dispose()
    note = f"{transactions} transactions per block, synchronous_commit={synchronous_commit}"
    cells = []
    for name, shape, target in (
        ("R5 one statement", ONE, ">= 0.8"),
        ("R5 five statements", FIVE, ">= 0.9"),
        (f"R5 {WRITERS} writers", MANY, ">= 0.85"),
    ):
        cell = Cell(
            name,
            f"{shape} + stage()",
            [f"{shape} alone"],
            "tx/s",
            target=target,
            measures=f"business transaction ({shape}) + stage() / without",
            notes=[note],
        )
        cell.take(run)
        cells.append(cell)
    notify_cell = Cell(
        "R5 NOTIFY (context)",
        f"{NOTIFY} + stage()",
        [f"{MANY} + stage()"],
        "tx/s",
        target="(context: why staging notifies only a sleeping relay)",
        measures=f"{WRITERS} writers + stage() with a relay asleep (a NOTIFY at each commit) / "
        "with relays awake (no NOTIFY)",
        notes=[note],
    )
    notify_cell.take(run)
    cells.append(notify_cell)
    return cells


_COLUMNS = (
    "id",
    "aggregatetype",
    "aggregateid",
    "type",
    "topic",
    "payload",
    "headers",
    "event_key",
)


def _raw_rows(events: list[TransferCompleted]) -> list[tuple[object, ...]]:
    """The outbox rows ``stage()`` writes for ``events``, as psycopg parameters."""
    codec = Codec(registry=registry)
    rows: list[tuple[object, ...]] = []
    for event in events:
        event_type = registry.for_model(type(event))
        payload, headers = codec.encode(event)
        event_id = uuid7()
        rows.append(
            (
                event_id,
                event_type.aggregate,
                event_type.key_of(event),
                event_type.name,
                event_type.topic,
                payload,
                Jsonb(headers),
                str(event_id),
            )
        )
    return rows


def _raw_insert(rows: int) -> str:
    values = ", ".join(["(" + ", ".join(["%s"] * len(_COLUMNS)) + ")"] * rows)
    return f"INSERT INTO oncely_outbox ({', '.join(_COLUMNS)}) VALUES {values}"


def measure_client(
    database_url: str, *, events: int, repetitions: int, batch: int = 100
) -> list[Cell]:
    """S-CPU (client CPU per event, stage() / raw psycopg) and S-MANY (stage_many() of
    ``batch`` events / one raw multi-row INSERT of the same rows)."""
    engine = sa.create_engine(database_url)
    upgrade(engine)
    raw_url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    per_transaction = 100  # S-CPU: events per transaction (the commit is not counted)

    def stage_cpu() -> float:
        _reset(engine, tables="oncely_outbox")
        batch_events, spent = _events(events), 0.0
        with Session(engine) as session:
            for start in range(0, events, per_transaction):
                with session.begin():
                    for event in batch_events[start : start + per_transaction]:
                        before = time.thread_time()
                        stage(session, event)
                        spent += time.thread_time() - before
        return spent / events * 1e6

    def raw_cpu() -> float:
        _reset(engine, tables="oncely_outbox")
        rows, spent = _raw_rows(_events(events)), 0.0
        sql = _raw_insert(1)
        with psycopg.connect(raw_url) as conn:
            for start in range(0, events, per_transaction):
                with conn.transaction():
                    for row in rows[start : start + per_transaction]:
                        before = time.thread_time()
                        conn.execute(sql, row)
                        spent += time.thread_time() - before
        return spent / events * 1e6

    def stage_many_rate() -> float:
        _reset(engine, tables="oncely_outbox")
        chunks = [_events(batch) for _ in range(max(1, events // batch))]
        with Session(engine) as session, cpu_window():
            started = time.perf_counter()
            for chunk in chunks:
                with session.begin():
                    stage_many(session, chunk)
            elapsed = time.perf_counter() - started
        return len(chunks) * batch / elapsed

    def raw_many_rate() -> float:
        _reset(engine, tables="oncely_outbox")
        chunks = [_raw_rows(_events(batch)) for _ in range(max(1, events // batch))]
        sql = _raw_insert(batch)
        with psycopg.connect(raw_url) as conn, cpu_window():
            started = time.perf_counter()
            for chunk in chunks:
                with conn.transaction():
                    conn.execute(sql, [value for row in chunk for value in row])
            elapsed = time.perf_counter() - started
        return len(chunks) * batch / elapsed

    sides = {
        "stage() CPU": stage_cpu,
        "raw psycopg INSERT CPU": raw_cpu,
        f"stage_many() of {batch}": stage_many_rate,
        f"raw {batch}-row INSERT": raw_many_rate,
    }
    try:
        run = interleave(sides, repetitions=repetitions)
    finally:
        _reset(engine, tables="oncely_outbox")
        engine.dispose()
    note = f"{events} events per block"
    cpu = Cell(
        "S-CPU",
        "stage() CPU",
        ["raw psycopg INSERT CPU"],
        "us CPU/event",
        target="<= 1.5",
        measures="client CPU per event: stage() on a Session / a raw psycopg INSERT of the "
        "same row (encoded beforehand)",
        notes=[note, f"{per_transaction} events per transaction, commit not counted"],
    )
    cpu.take(run)
    many = Cell(
        "S-MANY",
        f"stage_many() of {batch}",
        [f"raw {batch}-row INSERT"],
        "events/s",
        target=">= 0.8",
        measures=f"transactions of stage_many() of {batch} events / of one raw {batch}-row "
        "INSERT of the same rows (psycopg), commit included",
        notes=[note],
    )
    many.take(run)
    return [cpu, many]
