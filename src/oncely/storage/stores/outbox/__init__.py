"""The store of ``oncely_outbox`` and the relay's tables beside it: shards and members (the
relay's progress and leases), parked keys and held rows (dead and delayed rows), and the rows
of parked keys kept aside when their partition was dropped.

Every statement on these tables is in this package (its named SQL in ``storage/sql/outbox.sql``),
one module per role, so that each role's grants (:mod:`oncely.storage.roles`) read off its
module:

- :mod:`.writes`: producers add rows in their own transaction;
- :mod:`.relay`: the relay's snapshot reads, progress, leases, parked keys and held rows;
- :mod:`.dead`: operators list dead rows and ask for them to be requeued or skipped;
- :mod:`.reports`: what ``oncely status``, ``verify`` and ``replay --from-outbox`` read;
- :mod:`.debezium`: the purge of Debezium mode;
- :mod:`.kept`: retention keeps parked keys' rows aside when it drops their partition.

Rows come back as typed dataclasses: :class:`.rows.OutboxRow` for a row to publish, and each
module's own for what it reports. :mod:`.snapshots` is PostgreSQL's snapshot arithmetic the
relay reads by.
"""
