"""``oncely.App``: one application target for every command; the older targets (a Registry, an
Effects or a Tasks object) keep working."""

from __future__ import annotations

import json

import pytest
from examples.payments.app import app as payments
from examples.payments.effects import effects
from examples.payments.events import registry
from examples.payments.tasks import tasks

import oncely
from oncely.cli import app as cli
from oncely.cli._errors import run


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ONCELY_APP", "ONCELY_REGISTRY", "ONCELY_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)


def test_an_app_takes_its_registry_from_its_effects() -> None:
    assert oncely.App(effects=effects).registry is registry
    assert payments.require_registry("t") is registry
    assert payments.require_effects("t") is effects
    assert payments.require_tasks("t") is tasks


def test_effects_over_another_registry_are_refused() -> None:
    with pytest.raises(oncely.AppError, match="effects are declared over another Registry"):
        oncely.App(registry=oncely.Registry(), effects=effects)


@pytest.mark.parametrize(
    ("loaded", "has"),
    [(registry, "registry"), (effects, "effects"), (tasks, "tasks"), (payments, "all")],
)
def test_the_older_targets_are_apps_holding_them(loaded: object, has: str) -> None:
    found = oncely.App.of("m:a", loaded)
    assert (found.registry is registry) == (has in ("registry", "effects", "all"))
    assert (found.effects is effects) == (has in ("effects", "all"))
    assert (found.tasks is tasks) == (has in ("tasks", "all"))


def test_a_missing_part_names_the_target_and_the_fix() -> None:
    with pytest.raises(oncely.AppError, match=r"^m:a declares no tasks; give its App tasks=$"):
        oncely.App.of("m:a", registry).require_tasks("m:a")
    with pytest.raises(oncely.AppError, match=r"m:a is a int; name an oncely\.App"):
        oncely.App.of("m:a", 3)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = run(cli, argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_schemas_check_reads_the_app_from_app_or_oncely_app(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    by_option = _run(["schemas", "check", "--app", "examples.payments.app:app"], capsys)
    old_spelling = _run(
        ["schemas", "check", "--registry", "examples.payments.events:registry"], capsys
    )
    monkeypatch.setenv("ONCELY_APP", "examples.payments.app:app")
    by_environment = _run(["schemas", "check"], capsys)
    assert by_option[0] == old_spelling[0] == by_environment[0] == 0, by_option
    assert by_option[1] == old_spelling[1] == by_environment[1]
    assert "transfer.completed" in by_option[1]


NO_DATABASE = ["--database-url", "postgresql+psycopg://u@127.0.0.1:1/d"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["tasks", "run", *NO_DATABASE], "error: Invalid value for --app: name the application"),
        (["schemas", "check", "--app", "examples.payments.tasks:tasks"], "declares no event"),
        (["tasks", "run", "examples.payments.events:registry", *NO_DATABASE], "declares no tasks"),
    ],
)
def test_a_missing_or_wrong_app_is_one_line_and_status_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _run(argv, capsys)
    lines = err.splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert says in lines[0]


def test_schemas_check_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, stdout, _ = _run(
        ["schemas", "check", "--app", "examples.payments.app:app", "--json"], capsys
    )
    document = json.loads(stdout)
    assert status == 0 and document["compatible"] is True and document["incompatibilities"] == []
    assert {t["event_type"] for t in document["event_types"]} == {t.name for t in registry}
