"""Failpoints: crash or stall a process at a named point, for fault-injection tests.

Set ``ONCELY_FAILPOINTS`` before the process starts, e.g.
``ONCELY_FAILPOINTS=consumer.after_db_commit_before_offset_commit=exit``; several are separated
by commas. Actions: ``exit`` (``os._exit(137)``, as abrupt as SIGKILL: no cleanup, no flush),
``sleep:SECONDS``, ``exit-after:N`` (exit on the N-th time the point is reached) and
``stop-after:N`` (the process sends itself SIGSTOP on the N-th time only, and goes on from the
point once it gets SIGCONT: a paused process, a zombie, resumed exactly there). Unset,
:func:`failpoint` is one dictionary lookup on an empty dict.

Points of the relay loop, in the order a page meets them: ``relay.after_read`` (a page read,
nothing produced), ``relay.mid_page`` (half of the page produced),
``relay.after_produce_before_ack`` (all produced, no report yet),
``relay.after_ack_before_record`` (every record acknowledged, progress not written) and
``relay.after_record_before_commit`` (progress written, its transaction not committed); in
exactly-once mode also ``relay.before_commit`` (a page's records on the broker, its Kafka
transaction not committed; on the thread that commits it). A release of parked keys meets
``relay.after_release_before_unpark`` (their rows acknowledged, in exactly-once mode
committed; the keys not unparked). Of the
consumer: ``consumer.after_poll``,
``consumer.after_effect_before_db_commit``, ``consumer.after_db_commit_before_offset_commit``.
"""

from __future__ import annotations

import os
import signal
import time

from oncely.errors import ConfigurationError


def _parse(text: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, action = item.partition("=")
        if not sep or not (
            action in ("exit",) or action.startswith(("sleep:", "exit-after:", "stop-after:"))
        ):
            raise ConfigurationError(
                f"ONCELY_FAILPOINTS entry {item!r}: use name=exit, name=sleep:SECONDS, "
                "name=exit-after:N or name=stop-after:N"
            )
        points[name] = action
    return points


_ACTIVE = _parse(os.environ.get("ONCELY_FAILPOINTS", ""))
_HITS: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Act as ``ONCELY_FAILPOINTS`` says at the point ``name``; do nothing otherwise."""
    action = _ACTIVE.get(name)
    if action is None:
        return
    _HITS[name] = hits = _HITS.get(name, 0) + 1
    if action == "exit" or (action.startswith("exit-after:") and hits >= int(action[11:])):
        os._exit(137)
    if action.startswith("stop-after:") and hits == int(action[11:]):
        os.kill(os.getpid(), signal.SIGSTOP)
    if action.startswith("sleep:"):
        time.sleep(float(action[6:]))
