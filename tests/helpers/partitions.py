"""Partitioned test databases: the outbox and the receipts converted to one-minute partitions,
with the partitions of the last minutes created (retention then has closed partitions to judge)."""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa

from oncely.storage import partitions, upgrade
from tests.helpers.database import scalar

#: The step of the partitioned test databases.
MINUTE = timedelta(minutes=1)


def partitioned_by_minute(engine: sa.Engine, *, past: int = 20) -> datetime:
    """Convert ``engine``'s tables to one-minute partitions, create both tables' partitions of
    the last ``past`` minutes, and return the database's clock."""
    upgrade(engine, partition_every=MINUTE)
    moment: datetime = scalar(engine, "SELECT now()")
    start = partitions.window_start(moment, MINUTE)
    with engine.begin() as conn:
        for table in partitions.PARTITION_KEYS:
            for n in range(1, past + 1):
                partitions.create_partition(
                    conn, table, start - MINUTE * n, start - MINUTE * (n - 1)
                )
    return moment
