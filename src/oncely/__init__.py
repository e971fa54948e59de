"""oncely: transactional outbox to Kafka to effects, with no lost events and no double effects."""

from oncely.errors import OncelyError

__all__ = ["OncelyError"]
