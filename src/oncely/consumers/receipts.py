"""Receipt retention: purge an effect's old receipts, never while their records can be replayed.

A receipt is the only thing that stops a redelivered event from being applied again. Purging a
receipt while its record is still in the topic would let a replay apply that event twice, so
:func:`purge_receipts` refuses a horizon shorter than the longest retention of the effect's
topics unless forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, ConfigResource

from oncely.errors import OncelyError
from oncely.storage.stores import receipts as store
from oncely.storage.stores.receipts import ReceiptsPurge


class UnsafePurgeError(OncelyError):
    """The horizon is shorter than the topics' retention: a replay could apply events twice."""


def topic_retention(admin: AdminClient, topics: Sequence[str], *, timeout: float = 30) -> timedelta:
    """The longest ``retention.ms`` of ``topics`` (``-1``, infinite, as ``timedelta.max``)."""
    resources = [ConfigResource(ConfigResource.Type.TOPIC, topic) for topic in topics]
    longest = timedelta(0)
    for future in admin.describe_configs(resources).values():
        millis = int(future.result(timeout)["retention.ms"].value)
        if millis < 0:
            return timedelta.max
        longest = max(longest, timedelta(milliseconds=millis))
    return longest


def check_horizon(older_than: timedelta, retention: timedelta, *, force: bool = False) -> None:
    """Raise :class:`UnsafePurgeError` when ``older_than < retention`` and not ``force``."""
    if older_than < retention and not force:
        shown = "forever" if retention == timedelta.max else str(retention)
        raise UnsafePurgeError(
            f"receipts younger than the topics' retention ({shown}) may still be needed: a "
            f"replay could apply those events twice. Use a horizon of at least {shown}, or "
            "--force if you accept that."
        )


def preview_receipts(engine: sa.Engine, *, effect: str, older_than: timedelta) -> ReceiptsPurge:
    """What :func:`purge_receipts` would delete now (no horizon check); changes nothing."""
    return store.preview_purge(engine, effect=effect, older_than_seconds=older_than.total_seconds())


def purge_receipts(
    engine: sa.Engine,
    *,
    effect: str,
    older_than: timedelta,
    retention: timedelta,
    force: bool = False,
    batch_size: int = 5000,
) -> int:
    """Delete ``effect``'s receipts older than ``older_than`` in batches; return how many.

    Raises :class:`UnsafePurgeError` when ``older_than < retention`` and not ``force``.
    """
    check_horizon(older_than, retention, force=force)
    return store.purge(
        engine, effect=effect, older_than_seconds=older_than.total_seconds(), batch_size=batch_size
    )
