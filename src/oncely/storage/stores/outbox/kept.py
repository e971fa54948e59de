"""``oncely_relay_kept``: the rows of parked keys that retention keeps aside when it drops their
outbox partition, so that a dead, delayed or blocked row (and the rows held behind its key) no
longer keeps the partition, and every later one, for as long as it waits.

Retention copies them here (:func:`keep`) in the transaction that drops the partition; the
relay reads them from here when it releases the key, in the key's order, and deletes each copy
in the transaction that releases it (:class:`~oncely.storage.stores.outbox.relay.RelayStore`).
Operators see them through ``oncely dead list`` as before. A copy's idempotency key stays taken
while the copy exists (a trigger frees it when the copy is deleted).
"""

from __future__ import annotations

from uuid import UUID

import sqlalchemy as sa

from oncely.storage.queries import query


def keep(conn: sa.Connection, low: UUID, high: UUID) -> int:
    """Copy the outbox rows of the id range ``[low, high)`` that park a key or are held behind
    one, in ``conn``'s transaction (the one that drops the range's partition, after it has read
    the relay's progress and found every row of the range passed); return how many.

    The parked and held entries of the range stay locked until the transaction ends: a relay
    releasing one of those keys meanwhile waits for it, then deletes the copies it published.
    """
    params = {"low": str(low), "high": str(high)}
    conn.execute(query("kept_lock_held"), params)
    return conn.execute(query("kept_copy"), params).rowcount
