"""Failpoints: crash or stall a process at a named point, for fault-injection tests.

Set ``ONCELY_FAILPOINTS`` before the process starts, e.g.
``ONCELY_FAILPOINTS=consumer.after_db_commit_before_offset_commit=exit``; several are separated
by commas. Actions: ``exit`` (``os._exit(137)``, as abrupt as SIGKILL: no cleanup, no flush),
``sleep:SECONDS``, and ``exit-after:N`` (exit on the N-th time the point is reached). Unset,
:func:`failpoint` is one dictionary lookup on an empty dict.

Points: ``relay.after_claim``, ``relay.after_produce_before_ack``,
``relay.after_ack_before_mark``, ``relay.after_mark_before_commit``, ``consumer.after_poll``,
``consumer.after_effect_before_db_commit``, ``consumer.after_db_commit_before_offset_commit``.
"""

from __future__ import annotations

import os
import time

from oncely.errors import ConfigurationError


def _parse(text: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, action = item.partition("=")
        if not sep or not (action in ("exit",) or action.startswith(("sleep:", "exit-after:"))):
            raise ConfigurationError(
                f"ONCELY_FAILPOINTS entry {item!r}: use name=exit, name=sleep:SECONDS "
                "or name=exit-after:N"
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
    if action.startswith("sleep:"):
        time.sleep(float(action[6:]))
