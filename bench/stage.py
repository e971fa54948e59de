"""R5: the cost of ``stage()`` — a business transaction with one staged event vs without.

Both sides run the same business transaction (insert one row into a ``transfers`` table, commit)
over one connection; side B also stages one event (Avro). Blocks of ``--transactions`` alternate
A/B/A/B for ``--repetitions`` rounds after a warm-up, and the median ratio B/A of throughputs is
reported with its range. Events are built before the timed loop.

    python -m bench.stage [--transactions 2000] [--repetitions 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa
from examples.payments.events import TransferCompleted
from sqlalchemy.orm import Session

from bench.harness import Cell
from oncely.devstack import DevStack
from oncely.producer.staging import stage
from oncely.storage import upgrade


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


def _run(engine: sa.Engine, events: list[TransferCompleted], *, with_stage: bool) -> float:
    """Run one block of transactions; return transactions per second."""
    insert = sa.text("INSERT INTO transfers (id, amount) VALUES (:id, :amount)")
    with Session(engine) as session:
        started = time.perf_counter()
        for event in events:
            with session.begin():
                session.execute(insert, {"id": event.transfer_id, "amount": event.amount})
                if with_stage:
                    stage(session, event)
        elapsed = time.perf_counter() - started
    return len(events) / elapsed


def measure(database_url: str, *, transactions: int, repetitions: int) -> dict[str, object]:
    engine = sa.create_engine(database_url, pool_size=1)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE IF EXISTS transfers"))
        conn.execute(sa.text("CREATE TABLE transfers (id uuid PRIMARY KEY, amount numeric)"))
        synchronous_commit = conn.execute(sa.text("SHOW synchronous_commit")).scalar_one()
    sides: dict[str, Callable[[list[TransferCompleted]], float]] = {
        "without": lambda evs: _run(engine, evs, with_stage=False),
        "with": lambda evs: _run(engine, evs, with_stage=True),
    }
    for side in sides.values():  # warm-up, not reported
        side(_events(transactions // 4))
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(repetitions):
        for name, side in sides.items():
            rates[name].append(side(_events(transactions)))
    engine.dispose()
    cell = Cell(
        "R5",
        "business transaction + stage()",
        ["business transaction alone"],
        "tx/s",
        target=">= 0.95",
        notes=[f"{transactions} transactions per block, synchronous_commit={synchronous_commit}"],
    )
    cell.rates = {
        "business transaction + stage()": rates["with"],
        "business transaction alone": rates["without"],
    }
    return cell.to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    url = os.environ.get("ONCELY_DATABASE_URL")
    if url:
        result = measure(url, transactions=args.transactions, repetitions=args.repetitions)
    else:
        with DevStack() as stack:
            result = measure(
                stack.database_url, transactions=args.transactions, repetitions=args.repetitions
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
