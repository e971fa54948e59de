"""A real local Kafka + PostgreSQL without Docker, for development, tests and the demo."""

from oncely.devstack.cluster import KafkaCluster
from oncely.devstack.kafka import (
    DEFAULT_KAFKA_VERSION,
    KafkaNode,
    KafkaSecurity,
    KafkaTls,
    resolve_kafka_libs,
)
from oncely.devstack.postgres import PostgresNode
from oncely.devstack.stack import DevStack, StackInfo, default_stack_dir

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "DevStack",
    "KafkaCluster",
    "KafkaNode",
    "KafkaSecurity",
    "KafkaTls",
    "PostgresNode",
    "StackInfo",
    "default_stack_dir",
    "resolve_kafka_libs",
]
