"""Every transition of inbound idempotency keys, sync and async, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from oncely.producer.idempotency import (
    AsyncIdempotencyKeys,
    Claim,
    ClaimLostError,
    IdempotencyBusyError,
    IdempotencyKeys,
    IdempotencyMismatchError,
    InvalidIdempotencyKeyError,
)
from tests.helpers import execute, query_one

pytestmark = pytest.mark.integration


class _Keys:
    """The sync or the async implementation behind one blocking interface."""

    def __init__(self, url: str, *, use_async: bool) -> None:
        self.use_async = use_async
        if use_async:
            self._async_engine = create_async_engine(url)
            self._async = AsyncIdempotencyKeys(self._async_engine)
            self._loop = asyncio.new_event_loop()
        else:
            self._engine = sa.create_engine(url)
            self._sync = IdempotencyKeys(self._engine)

    def claim(self, owner: str, key: str, **kwargs: Any) -> Claim:
        if self.use_async:
            return self._loop.run_until_complete(self._async.claim(owner, key, **kwargs))
        return self._sync.claim(owner, key, **kwargs)

    def finish(self, owner: str, key: str, status: Any, **kwargs: Any) -> None:
        if self.use_async:
            self._loop.run_until_complete(self._async.finish(owner, key, status, **kwargs))
        else:
            self._sync.finish(owner, key, status, **kwargs)

    def close(self) -> None:
        if self.use_async:
            self._loop.run_until_complete(self._async_engine.dispose())
            self._loop.close()
        else:
            self._engine.dispose()


@pytest.fixture(params=["sync", "async"])
def keys(request: pytest.FixtureRequest, database_url: str) -> Iterator[_Keys]:
    implementation = _Keys(database_url, use_async=request.param == "async")
    yield implementation
    implementation.close()


def _age(database_url: str, owner: str, key: str, seconds: int) -> None:
    execute(
        database_url,
        "UPDATE oncely_idempotency_keys SET received_at = now() - make_interval(secs => :s)"
        " WHERE owner = :o AND key = :k",
        s=seconds,
        o=owner,
        k=key,
    )


def _row(database_url: str, owner: str, key: str) -> dict[str, Any]:
    row = query_one(
        database_url,
        "SELECT * FROM oncely_idempotency_keys WHERE owner = :o AND key = :k",
        o=owner,
        k=key,
    )
    return dict(row._mapping)


def test_first_claim_processes(keys: _Keys, database_url: str) -> None:
    assert keys.claim("hook-1", "k1", extra={"api_key": "ak_1"}) == Claim(None, reclaimed=False)
    row = _row(database_url, "hook-1", "k1")
    assert row["status"] == "processing"
    assert row["extra"] == {"api_key": "ak_1"}


def test_accepted_returns_the_previous_result_as_a_duplicate(keys: _Keys) -> None:
    keys.claim("user-9", "order-1")
    keys.finish("user-9", "order-1", "accepted", detail="created", result={"run_id": "r-1"})
    claim = keys.claim("user-9", "order-1")
    assert claim.duplicate
    assert claim.previous == {
        "status": "accepted",
        "detail": "created",
        "result": {"run_id": "r-1"},
        "duplicate": True,
    }
    assert not claim.reclaimed


def test_rejected_is_claimed_again_with_the_new_fingerprint(keys: _Keys, database_url: str) -> None:
    keys.claim("hook-1", "k2", fingerprint="fp-a")
    keys.finish("hook-1", "k2", "rejected", detail="no pending task")
    assert keys.claim("hook-1", "k2", fingerprint="fp-b") == Claim(None, reclaimed=False)
    row = _row(database_url, "hook-1", "k2")
    assert (row["status"], row["fingerprint"], row["detail"]) == ("processing", "fp-b", None)


def test_fresh_processing_is_busy(keys: _Keys) -> None:
    keys.claim("hook-1", "k3")
    with pytest.raises(IdempotencyBusyError, match="being processed") as info:
        keys.claim("hook-1", "k3")
    assert info.value.http_status == 409


def test_stale_processing_is_reclaimed(keys: _Keys, database_url: str) -> None:
    keys.claim("hook-1", "k4")
    _age(database_url, "hook-1", "k4", 601)
    assert keys.claim("hook-1", "k4") == Claim(None, reclaimed=True)
    # The re-claim restarted the clock: a third request is busy again.
    with pytest.raises(IdempotencyBusyError):
        keys.claim("hook-1", "k4")


def test_stale_limit_is_configurable(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    short = IdempotencyKeys(engine, stale_after=5)
    short.claim("hook-1", "k5")
    _age(database_url, "hook-1", "k5", 6)
    assert short.claim("hook-1", "k5").reclaimed
    engine.dispose()


@pytest.mark.parametrize("state", ["accepted", "processing"])
def test_a_different_fingerprint_is_a_mismatch(keys: _Keys, state: str) -> None:
    keys.claim("user-9", f"pay-{state}", fingerprint="body-1")
    if state == "accepted":
        keys.finish("user-9", f"pay-{state}", "accepted", result={"id": 1})
    with pytest.raises(IdempotencyMismatchError, match="different request") as info:
        keys.claim("user-9", f"pay-{state}", fingerprint="body-2")
    assert info.value.http_status == 422


def test_owners_do_not_share_keys(keys: _Keys) -> None:
    keys.claim("hook-1", "same")
    assert keys.claim("hook-2", "same") == Claim(None, reclaimed=False)


def test_keys_longer_than_200_characters_are_refused(keys: _Keys) -> None:
    assert keys.claim("hook-1", "x" * 200) == Claim(None, reclaimed=False)
    with pytest.raises(InvalidIdempotencyKeyError, match="201 characters"):
        keys.claim("hook-1", "x" * 201)
    with pytest.raises(InvalidIdempotencyKeyError):
        keys.claim("hook-1", "")


def test_finish_without_a_processing_claim_is_refused(keys: _Keys) -> None:
    with pytest.raises(ClaimLostError):
        keys.finish("hook-1", "never-claimed", "accepted")
    keys.claim("hook-1", "k6")
    keys.finish("hook-1", "k6", "accepted")
    with pytest.raises(ClaimLostError):
        keys.finish("hook-1", "k6", "rejected")


ROUNDS = 100


def _racer(url: str, barrier: Any, results: Any) -> None:
    engine = sa.create_engine(url)
    keys = IdempotencyKeys(engine)
    for round_no in range(ROUNDS):
        barrier.wait()
        try:
            outcome = "won" if keys.claim("hook-race", f"key-{round_no}").reclaimed else "fresh"
        except IdempotencyBusyError:
            outcome = "busy"
        results.put((round_no, outcome))
    engine.dispose()


def test_two_processes_reclaiming_a_stale_key_exactly_one_wins(database_url: str) -> None:
    execute(
        database_url,
        "INSERT INTO oncely_idempotency_keys (owner, key, status, received_at)"
        " SELECT 'hook-race', 'key-' || n, 'processing', now() - interval '1 hour'"
        " FROM generate_series(0, :last) AS n",
        last=ROUNDS - 1,
    )
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    racers = [context.Process(target=_racer, args=(database_url, barrier, results)) for _ in "ab"]
    for racer in racers:
        racer.start()
    outcomes: dict[int, list[str]] = {}
    for _ in range(2 * ROUNDS):
        round_no, outcome = results.get(timeout=120)
        outcomes.setdefault(round_no, []).append(outcome)
    for racer in racers:
        racer.join(timeout=30)
        assert racer.exitcode == 0
    assert len(outcomes) == ROUNDS
    assert all(sorted(pair) == ["busy", "won"] for pair in outcomes.values()), outcomes
