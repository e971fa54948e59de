"""Retention of the time-partitioned outbox and receipts: guarded partition drops.

:func:`plan` says what a run would do; :func:`run` creates partitions ahead and drops those
:mod:`.guard` lets go (see :mod:`.maintenance`); :func:`.kafka.watermarks` asks Kafka where its
logs start and end. The tables are partitioned by ``oncely db upgrade --partition-every``
(:mod:`oncely.storage.partitions`).
"""

from oncely.retention.guard import Verdict
from oncely.retention.kafka import KafkaUnansweredError, watermarks
from oncely.retention.maintenance import (
    NotPartitionedError,
    Outcome,
    Plan,
    Policy,
    TableState,
    plan,
    policy_of,
    run,
    states,
)
from oncely.retention.report import document, record

__all__ = [
    "KafkaUnansweredError",
    "NotPartitionedError",
    "Outcome",
    "Plan",
    "Policy",
    "TableState",
    "Verdict",
    "document",
    "plan",
    "policy_of",
    "record",
    "run",
    "states",
    "watermarks",
]
