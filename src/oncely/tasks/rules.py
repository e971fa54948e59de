"""The decisions of durable tasks, as pure functions over values (no I/O, unit-tested).

What happened, and the task's next state:

- the handler returned anything but ``False``: ``completed``;
- the handler raised, or returned ``False`` ("not confirmed"): ``queued`` again after
  ``min(cap, base ** (attempt - 1))`` seconds; ``dead`` once ``attempt >= max_attempts``;
- the lease expired, irreversible: ``stale``: the effect may have happened, so it never re-runs
  by itself; an operator checks and runs ``oncely tasks reclaim``;
- the lease expired, retry-safe: ``expired`` past the TTL (that wins over re-queueing);
  ``failed`` once ``attempt >= max_attempts`` ("leased N times without a result"); otherwise
  ``queued``, due at once;
- queued past its TTL: ``expired`` (it never ran).

So a retry-safe handler must finish within its lease (or it runs twice, and the first result
is refused), and an irreversible one renews its lease while it works.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from oncely.runtime.retry import Backoff

DEFAULT_BACKOFF = Backoff(first=1.0, maximum=3600.0)
"""A task's retries: 1 s after the first failure, doubling, at most an hour."""

Policy = Literal["retry_safe", "irreversible"]
"""What an expired lease does to a task: ``"retry_safe"`` runs it again, ``"irreversible"``
makes it ``stale`` until an operator reclaims it."""
LapsedStatus = Literal["queued", "stale", "failed", "expired"]

DEFAULT_MAX_ATTEMPTS = 5
NOT_CONFIRMED = "not confirmed: the handler returned False"


@dataclass(frozen=True)
class FailureDecision:
    """What a failed attempt leads to: ``dead``, or a retry after ``delay`` seconds."""

    dead: bool
    delay: float


def after_failure(attempt: int, max_attempts: int, backoff: Backoff) -> FailureDecision:
    """A failed attempt (raised or not confirmed) is retried with backoff, or is the last one."""
    if attempt >= max_attempts:
        return FailureDecision(dead=True, delay=0.0)
    return FailureDecision(dead=False, delay=backoff.delay(attempt))


@dataclass(frozen=True)
class LapseDecision:
    """Where a task whose lease expired goes, and the reason recorded as its ``last_error``."""

    status: LapsedStatus
    reason: str

    @property
    def finished(self) -> bool:
        """Terminal: the task gets ``finished_at`` and is purged after the retention period."""
        return self.status in ("failed", "expired")


def after_lease_expiry(
    *, policy: Policy, attempt: int, max_attempts: int, past_ttl: bool, owner: str
) -> LapseDecision:
    """Decide the fate of a task whose lease ran out without a result: an irreversible one is
    ``stale`` (an operator decides); a retry-safe one is ``expired`` past its TTL, ``failed``
    out of attempts, else ``queued`` again."""
    lapsed = f"the lease of {owner} on attempt {attempt} expired without a result"
    if policy == "irreversible":
        return LapseDecision(
            "stale",
            f"{lapsed}; the effect may have happened, so it is not re-run: check the provider "
            "(by the task's idempotency key), then `oncely tasks reclaim` it if it did not",
        )
    if past_ttl:
        return LapseDecision("expired", f"{lapsed}, and the task's TTL has passed")
    if attempt >= max_attempts:
        return LapseDecision("failed", f"leased {attempt} times without a result")
    return LapseDecision("queued", f"{lapsed}; re-queued")


def canonical_json(payload: Mapping[str, Any]) -> str:
    """The payload as canonical JSON: sorted keys, no spaces, UTF-8 kept.

    Raises ``TypeError`` when the payload is not JSON (a datetime, a set, ...).
    """
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def default_task_key(name: str, payload: Mapping[str, Any]) -> str:
    """``<name>:<first 32 hex digits of sha256(canonical JSON payload)>``.

    So one (name, payload) pair is one task for as long as its row exists: enqueueing it again
    is a duplicate. Pass your own ``task_key`` when the same payload may legitimately repeat.
    """
    digest = hashlib.sha256(canonical_json(payload).encode()).hexdigest()
    return f"{name}:{digest[:32]}"


def iso_z(moment: datetime | None) -> str:
    """ISO-8601 in UTC with a ``Z`` suffix, to the second (``""`` for ``None``)."""
    if moment is None:
        return ""
    return moment.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
