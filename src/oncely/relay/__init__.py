"""The relay: read outbox rows per leased shard, publish them, record progress once confirmed."""

from oncely.relay.relay import Relay
from oncely.relay.service import build_relay, run_relay

__all__ = ["Relay", "build_relay", "run_relay"]
