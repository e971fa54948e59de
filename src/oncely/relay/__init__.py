"""The relay: claim due outbox rows, publish them to Kafka, settle them after confirmation."""

from oncely.relay.relay import Relay
from oncely.relay.service import build_relay, run_relay

__all__ = ["Relay", "build_relay", "run_relay"]
