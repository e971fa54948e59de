"""Recovery: re-read a topic for an effect; receipts keep effects single.

:func:`plan_reset` / :func:`execute_reset` move an effect group's committed offsets (to the
earliest offset, to the first offset at or after a time, or to an explicit offset), like
``kafka-consumer-groups --reset-offsets``. Refused while the group has members
(:func:`reset_refusal` says so): stop its consumers first. A consumer killed without leaving stays a
member until its session times out: the consumers' ``session.timeout.ms``, which the group's
description does not show (oncely's consumers: ``ONCELY_CONSUMER_SESSION_TIMEOUT_MS``).
Republishing outbox rows is :mod:`oncely.ops.republish`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from oncely.consumers.offsets import committed_offsets
from oncely.errors import OncelyError
from oncely.settings import ClientConfig, ConsumerSettings

#: How long a killed consumer of oncely's stays a member by default, in seconds.
DEFAULT_SESSION_SECONDS = ConsumerSettings.model_fields["session_timeout_ms"].default / 1000


class ReplayError(OncelyError):
    """The replay cannot be planned or applied as asked."""


@dataclass(frozen=True)
class Earliest:
    pass


@dataclass(frozen=True)
class AtTime:
    moment: datetime


@dataclass(frozen=True)
class AtOffset:
    topic: str
    partition: int
    offset: int


Target = Earliest | AtTime | AtOffset


@dataclass(frozen=True)
class PartitionMove:
    """One partition of the plan: committed offset (``None``: never committed) -> new offset."""

    topic: str
    partition: int
    current: int | None
    target: int
    high: int

    @property
    def to_reread(self) -> int:
        """Records the group will read again (from the new offset up to where it was)."""
        end = self.high if self.current is None else self.current
        return max(0, end - self.target)

    @property
    def skips(self) -> int:
        """Records the group would never read: the move goes forward past unread records."""
        start = self.current if self.current is not None else 0
        return max(0, self.target - start)


@dataclass(frozen=True)
class GroupMember:
    """An active member of a consumer group, as its coordinator describes it."""

    member_id: str
    client_id: str
    host: str


def group_members(
    client: ClientConfig | AdminClient, group: str, *, timeout: float = 30
) -> list[GroupMember]:
    """The active members of ``group`` (none for a group that does not exist), asked with
    ``client`` (an ``AdminClient``, or the configuration of a new one)."""
    admin = client if isinstance(client, AdminClient) else AdminClient(client)
    description = admin.describe_consumer_groups([group])[group].result(timeout)
    return [GroupMember(m.member_id, m.client_id, m.host) for m in description.members]


@dataclass(frozen=True)
class Refusal:
    """Why a group's offsets may not be reset now: it has active members."""

    group: str
    members: tuple[GroupMember, ...]

    @property
    def message(self) -> str:
        """The members (three named), and when a killed one stops counting."""
        members = self.members
        shown = ", ".join(f"{m.client_id}@{m.host.lstrip('/')}" for m in members[:3])
        more = f" and {len(members) - 3} more" if len(members) > 3 else ""
        return (
            f"group {self.group!r} has {len(members)} active member(s) ({shown}{more}): stop "
            "its consumers, then replay (a consumer killed without leaving stays a member until "
            "its session expires: within the consumers' session timeout, "
            f"ONCELY_CONSUMER_SESSION_TIMEOUT_MS, {DEFAULT_SESSION_SECONDS:g} s by default)"
        )


def reset_refusal(
    client: ClientConfig | AdminClient, group: str, *, timeout: float = 30
) -> Refusal | None:
    """Why resetting ``group``'s offsets is refused now (it has active members), or ``None``:
    what :func:`execute_reset` checks first, for a dry run to show."""
    members = group_members(client, group, timeout=timeout)
    return Refusal(group, tuple(members)) if members else None


def plan_reset(
    config: ClientConfig,
    *,
    group: str,
    topics: Sequence[str],
    target: Target,
    timeout: float = 30,
) -> list[PartitionMove]:
    """Where each partition of ``topics`` would move for ``group``; changes nothing."""
    lookup = Consumer({**config, "group.id": f"{group}.oncely-replay-plan"})
    try:
        metadata = lookup.list_topics(timeout=timeout)
        partitions = []
        for topic in topics:
            if topic not in metadata.topics:
                raise ReplayError(f"topic {topic!r} does not exist")
            partitions += [
                TopicPartition(topic, p) for p in sorted(metadata.topics[topic].partitions)
            ]
        committed = committed_offsets(config, group, partitions, timeout)
        if isinstance(target, AtTime):
            millis = int(target.moment.timestamp() * 1000)
            found = lookup.offsets_for_times(
                [TopicPartition(tp.topic, tp.partition, millis) for tp in partitions], timeout
            )
            by_time = {(tp.topic, tp.partition): tp.offset for tp in found}
        moves = []
        for tp in partitions:
            low, high = lookup.get_watermark_offsets(tp, timeout=timeout)
            key = (tp.topic, tp.partition)
            current = committed.get(key)
            current = current if current is not None and current >= 0 else None
            if isinstance(target, Earliest):
                new = low
            elif isinstance(target, AtTime):
                new = by_time[key] if by_time[key] >= 0 else high
            elif (target.topic, target.partition) == key:
                if not low <= target.offset <= high:
                    raise ReplayError(
                        f"offset {target.offset} of {target.topic}[{target.partition}] is outside "
                        f"the retained range {low}..{high}"
                    )
                new = target.offset
            else:
                continue
            moves.append(PartitionMove(tp.topic, tp.partition, current, new, high))
        if isinstance(target, AtOffset) and not moves:
            raise ReplayError(
                f"{target.topic}[{target.partition}] is not a partition of the effect"
            )
        return moves
    finally:
        lookup.close()


def execute_reset(
    config: ClientConfig,
    *,
    group: str,
    moves: Sequence[PartitionMove],
    timeout: float = 30,
) -> None:
    """Commit the planned offsets for ``group``; raises :class:`ReplayError` with the
    :class:`Refusal`'s message while the group has members."""
    admin = AdminClient(config)
    refusal = reset_refusal(admin, group, timeout=timeout)
    if refusal is not None:
        raise ReplayError(refusal.message)
    partitions = [TopicPartition(m.topic, m.partition, m.target) for m in moves]
    request = [ConsumerGroupTopicPartitions(group, partitions)]
    admin.alter_consumer_group_offsets(request)[group].result(timeout)
