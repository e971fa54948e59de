"""Taking shards in Kafka too, in exactly-once mode: each shard just leased has its producer
started (fencing its previous owner) and starts where Kafka has it when that is ahead of its
recorded progress (a transaction committed, its progress not yet recorded), recorded first.
At least once, the publisher takes nothing and the leases stand as they are. Gets the loop's
store and publisher, and calls the database through its guard.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException

from oncely.relay.ports import FAILED, Guard, Sources
from oncely.storage.stores.outbox.relay import ShardProgress

log = logging.getLogger(__name__)


def in_kafka(io: Sources, leases: list[ShardProgress], *, db: Guard) -> list[ShardProgress]:
    """``leases``, each from where Kafka has it when that is ahead; none (given back) when the
    publisher cannot take them (the broker does not answer) or the database fails."""
    publisher, store = io.publisher, io.store
    try:
        positions = publisher.take([lease.shard for lease in leases])
    except KafkaException as exc:
        log.warning("could not take shards in Kafka, giving them back: %s", exc)
        db("give back", lambda: store.release([(s.shard, s.epoch) for s in leases]))
        return []
    ahead = [
        ShardProgress(lease.shard, lease.epoch, positions[lease.shard])
        for lease in leases
        if lease.shard in positions and positions[lease.shard].beyond(lease.progress)
    ]
    if not ahead:
        return leases
    recorded = db("progress", lambda: store.record(ahead))
    if recorded is FAILED:
        for lease in leases:
            publisher.drop(lease.shard)
        db("give back", lambda: store.release([(s.shard, s.epoch) for s in leases]))
        return []
    adopted = {p.shard: p for p in ahead if p.shard in recorded}
    log.info("took shards %s from where Kafka has them", sorted(adopted))
    return [adopted.get(lease.shard, lease) for lease in leases]


def renew(
    io: Sources,
    leases: list[ShardProgress],
    *,
    held: list[tuple[int, int]],
    asleep: bool,
    db: Guard,
) -> list[ShardProgress]:
    """Renew ``leases`` (with the ``held`` ones) after taking them in Kafka took a third of a
    lease or more; those lost meanwhile are dropped."""
    renewed = db(
        "lease renewal",
        lambda: io.store.heartbeat(
            ttl_seconds=io.settings.lease_seconds,
            asleep=asleep,
            leases=[(lease.shard, lease.epoch) for lease in leases] + held,
        ),
    )
    kept = frozenset() if renewed is FAILED else renewed.kept
    for lease in leases:
        if lease.shard not in kept:
            io.publisher.drop(lease.shard)
    return [lease for lease in leases if lease.shard in kept]
