"""The decisions of durable tasks, as pure functions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from oncely.errors import MAX_ERROR_TEXT, ConfigurationError, error_text
from oncely.tasks import MissingHandlerError, Task, Tasks
from oncely.tasks.rules import (
    DEFAULT_BACKOFF,
    Backoff,
    FailureDecision,
    after_failure,
    after_lease_expiry,
    default_task_key,
    iso_z,
)


@pytest.mark.parametrize(
    ("attempt", "seconds"), [(1, 1), (2, 2), (3, 4), (10, 512), (12, 2048), (13, 3600), (40, 3600)]
)
def test_backoff_doubles_up_to_an_hour(attempt: int, seconds: float) -> None:
    assert DEFAULT_BACKOFF.delay(attempt) == seconds


def test_backoff_is_configurable() -> None:
    assert Backoff(first=1, multiplier=3, maximum=10).delay(3) == 9
    assert Backoff(first=1, multiplier=3, maximum=10).delay(4) == 10
    assert Backoff(first=1, maximum=0).delay(5) == 0


def test_a_failure_is_retried_until_the_last_attempt_which_is_dead() -> None:
    assert after_failure(1, 5, DEFAULT_BACKOFF) == FailureDecision(dead=False, delay=1)
    assert after_failure(4, 5, DEFAULT_BACKOFF) == FailureDecision(dead=False, delay=8)
    assert after_failure(5, 5, DEFAULT_BACKOFF) == FailureDecision(dead=True, delay=0)
    # A reclaimed dead task that fails again is dead at once.
    assert after_failure(6, 5, DEFAULT_BACKOFF).dead


def test_an_irreversible_lease_expiry_is_stale_never_requeued() -> None:
    for past_ttl in (False, True):
        for attempt in (1, 5):
            decision = after_lease_expiry(
                policy="irreversible",
                attempt=attempt,
                max_attempts=5,
                past_ttl=past_ttl,
                owner="w-1",
            )
            assert decision.status == "stale"
            assert not decision.finished
            assert "reclaim" in decision.reason


def test_a_retry_safe_lease_expiry_is_requeued() -> None:
    decision = after_lease_expiry(
        policy="retry_safe", attempt=2, max_attempts=5, past_ttl=False, owner="w-1"
    )
    assert decision.status == "queued"
    assert not decision.finished
    assert "w-1" in decision.reason


def test_the_ttl_wins_over_requeueing_and_over_failing() -> None:
    for attempt in (1, 5):
        decision = after_lease_expiry(
            policy="retry_safe", attempt=attempt, max_attempts=5, past_ttl=True, owner="w"
        )
        assert (decision.status, decision.finished) == ("expired", True)


def test_a_retry_safe_task_leased_max_attempts_times_fails() -> None:
    decision = after_lease_expiry(
        policy="retry_safe", attempt=3, max_attempts=3, past_ttl=False, owner="w"
    )
    assert (decision.status, decision.finished) == ("failed", True)
    assert decision.reason == "leased 3 times without a result"


def test_error_text_names_the_type_and_is_cut_to_4000_characters() -> None:
    assert error_text(ValueError("bad")) == "ValueError: bad"
    assert error_text("x" * 5000) == "x" * MAX_ERROR_TEXT


def test_the_default_key_is_the_name_and_a_hash_of_the_canonical_payload() -> None:
    key = default_task_key("email.send", {"to": "a@example.com", "n": [1, 2]})
    assert key.startswith("email.send:")
    assert len(key) == len("email.send:") + 32
    assert key == default_task_key("email.send", {"n": [1, 2], "to": "a@example.com"})
    assert key != default_task_key("email.send", {"to": "b@example.com", "n": [1, 2]})
    assert key != default_task_key("sms.send", {"to": "a@example.com", "n": [1, 2]})
    with pytest.raises(TypeError):
        default_task_key("x", {"when": datetime.now(UTC)})


def test_timestamps_print_as_utc_with_z() -> None:
    moment = datetime(2026, 3, 1, 12, 30, 5, 999, tzinfo=timezone(timedelta(hours=2)))
    assert iso_z(moment) == "2026-03-01T10:30:05Z"
    assert iso_z(None) == ""


def test_handlers_are_registered_once_and_missing_names_are_listed() -> None:
    tasks = Tasks(required={"sms.send"})

    @tasks.handler("email.send")
    def send(task: Task) -> None:
        return None

    assert tasks.names == {"email.send"}
    with pytest.raises(ConfigurationError, match="already has a handler"):
        tasks.handler("email.send")(send)
    assert tasks.missing(["email.send", "webhook.post"]) == ["sms.send", "webhook.post"]
    error = MissingHandlerError(["webhook.post", "sms.send"])
    assert error.names == ("sms.send", "webhook.post")
    assert "'sms.send', 'webhook.post'" in str(error)
    assert isinstance(error, ConfigurationError)
