"""Renamed settings keep working under their old names, with a one-line deprecation warning."""

from __future__ import annotations

import logging

import pytest

from oncely.cli._environment import known_variables, unknown_variables
from oncely.settings import RelaySettings, TaskSettings
from tests.helpers import oncely_cli

DEPRECATED = "is deprecated and will be removed"


@pytest.fixture(autouse=True)
def _no_relay_or_task_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OWNER_ID", "RELAY_ID", "INITIAL_BACKOFF_SECONDS", "BACKOFF_BASE_SECONDS"):
        monkeypatch.delenv(f"ONCELY_RELAY_{name}", raising=False)
    for name in ("OWNER_ID", "WORKER_ID", "POLL_INTERVAL_SECONDS", "POLL_SECONDS"):
        monkeypatch.delenv(f"ONCELY_TASKS_{name}", raising=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "oncely.settings"]


def test_an_old_variable_sets_the_new_setting_and_says_what_to_use(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ONCELY_RELAY_BACKOFF_BASE_SECONDS", "0.25")
    monkeypatch.setenv("ONCELY_TASKS_POLL_SECONDS", "7")
    with caplog.at_level(logging.WARNING, logger="oncely.settings"):
        relay, tasks = RelaySettings(), TaskSettings()
    assert relay.initial_backoff_seconds == 0.25
    assert tasks.poll_interval_seconds == 7
    assert _warnings(caplog) == [
        "the setting backoff_base_seconds (ONCELY_RELAY_BACKOFF_BASE_SECONDS, "
        f"--backoff-base-seconds) {DEPRECATED}: use initial_backoff_seconds "
        "(ONCELY_RELAY_INITIAL_BACKOFF_SECONDS, --initial-backoff-seconds)",
        f"the setting poll_seconds (ONCELY_TASKS_POLL_SECONDS, --poll-seconds) {DEPRECATED}: "
        "use poll_interval_seconds (ONCELY_TASKS_POLL_INTERVAL_SECONDS, --poll-interval-seconds)",
    ]


def test_the_new_variable_wins_over_the_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_RELAY_RELAY_ID", "old")
    monkeypatch.setenv("ONCELY_RELAY_OWNER_ID", "new")
    assert RelaySettings().owner_id == "new"


def test_an_old_keyword_wins_over_a_variable_as_any_keyword_does(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ONCELY_TASKS_OWNER_ID", "from-the-environment")
    with caplog.at_level(logging.WARNING, logger="oncely.settings"):
        settings = TaskSettings(worker_id="given")  # type: ignore[call-arg]
    assert settings.owner_id == "given"
    assert len(_warnings(caplog)) == 1
    assert _warnings(caplog)[0].startswith("the setting worker_id (ONCELY_TASKS_WORKER_ID, ")


def test_an_old_value_is_validated_as_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_RELAY_BACKOFF_MAX_SECONDS", "-1")
    with pytest.raises(ValueError, match="max_backoff_seconds"):
        RelaySettings()


def test_old_variables_are_known_so_none_is_called_ignored() -> None:
    environ = {"ONCELY_RELAY_RELAY_ID": "a", "ONCELY_TASKS_WORKER_ID": "b"}
    assert unknown_variables(environ, known_variables()) == []


def test_an_old_option_still_works_with_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_RELAY_BATCH_SIZE", "many")  # stops the command before it connects
    result = oncely_cli(
        "relay",
        "run",
        "--relay-id",
        "r1",
        "--database-url",
        "postgresql://u@127.0.0.1:1/x",
        "--bootstrap-servers",
        "127.0.0.1:1",
    )
    assert result.exit_code == 2, result.output
    assert "the setting relay_id (ONCELY_RELAY_RELAY_ID, --relay-id) is deprecated" in result.stderr
    assert "use owner_id (ONCELY_RELAY_OWNER_ID, --owner-id)" in result.stderr
