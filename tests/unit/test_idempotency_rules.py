"""The idempotency rules where a database cannot easily be made to misbehave."""

from __future__ import annotations

import pytest

from oncely.producer.idempotency import IdempotencyBusyError, _claim_steps


def test_a_row_that_vanishes_between_conflict_and_read_is_busy() -> None:
    steps = _claim_steps("hook-1", "k", None, None, 600.0)
    next(steps)  # the insert ...
    steps.send(None)  # ... conflicted: now the read ...
    with pytest.raises(IdempotencyBusyError, match="changed while being read"):
        steps.send(None)  # ... finds no row
