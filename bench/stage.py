"""R5: the cost of ``stage()`` — a business transaction with one staged event / without.

Three shapes of business transaction, each measured with and without ``stage()`` (Avro, one
event per transaction), all sides interleaved in one run after a warm-up:

- **one statement**: insert one row into ``transfers``, commit (target >= 0.8);
- **five statements**: insert the transfer, update two account balances, insert two ledger
  lines, commit (target >= 0.95);
- **8 concurrent writers**: the one-statement transaction from 8 threads, each with its own
  connection (target >= 0.9). This is where a NOTIFY per commit would show: PostgreSQL
  serialises committing transactions that notify. Staging notifies only while a relay sleeps;
  a context cell runs the same 8 writers with a relay marked asleep (a NOTIFY at every commit)
  / with none asleep.

Each block commits ``transactions`` transactions on an emptied outbox; the rate is tx/s.
Events are built before the timed loop.

    python -m bench.stage [--transactions 2000] [--repetitions 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa
from examples.payments.events import TransferCompleted
from sqlalchemy.orm import Session

from bench.harness import Cell, cpu_window, interleave
from oncely.devstack import DevStack
from oncely.producer.staging import stage
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


def _reset(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE oncely_outbox, transfers, ledger"))


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


def measure(database_url: str, *, transactions: int, repetitions: int) -> list[Cell]:
    """The R5 cells (one statement, five statements, 8 writers) and the NOTIFY context cell."""
    engine = sa.create_engine(database_url, pool_size=WRITERS + 2)
    upgrade(engine)
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
        ("R5 five statements", FIVE, ">= 0.95"),
        (f"R5 {WRITERS} writers", MANY, ">= 0.9"),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    url = os.environ.get("ONCELY_DATABASE_URL")
    with contextlib.ExitStack() as stack:
        if not url:
            url = stack.enter_context(DevStack()).database_url
        cells = measure(url, transactions=args.transactions, repetitions=args.repetitions)
    print(json.dumps([cell.to_json() for cell in cells], indent=2))


if __name__ == "__main__":
    main()
