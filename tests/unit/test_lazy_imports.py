"""Starting fast: ``import oncely`` and the ``oncely`` command load a part of the package only
when it is used; what they list without loading stays true to what they load."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest
import typer

import oncely
from oncely.cli import COMMANDS, app, load_command


def _loaded_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(done.stdout.split())


HEAVY = {
    "sqlalchemy",
    "confluent_kafka",
    "psycopg",
    "fastavro",
    "alembic",
    "fastapi",
    "oncely.consumers",
}


def test_import_oncely_and_the_root_help_load_no_service() -> None:
    assert not HEAVY & _loaded_after("import oncely")
    help_run = "import contextlib\nfrom oncely.cli import app\nfrom oncely.cli._errors import run"
    help_run += "\nwith contextlib.redirect_stdout(None): run(app, ['--help'])"
    loaded = _loaded_after(help_run)
    assert not HEAVY & loaded, HEAVY & loaded


def test_a_command_s_help_loads_only_its_own_area() -> None:
    code = "import contextlib\nfrom oncely.cli import app\nfrom oncely.cli._errors import run"
    code += "\nwith contextlib.redirect_stdout(None): run(app, ['relay', 'run', '--help'])"
    loaded = _loaded_after(code)
    assert "oncely.cli.relay" in loaded
    assert not {"oncely.cli.consume", "oncely.consumers", "oncely.relay.relay"} & loaded


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_listed_help_is_the_command_s_own(name: str) -> None:
    command = load_command(name)
    assert command.get_short_help_str(1000) == COMMANDS[name][1]


def test_every_command_is_listed() -> None:
    root = typer.main.get_command(app)
    assert list(root.commands) == list(COMMANDS)  # type: ignore[attr-defined]


def test_every_public_name_resolves_to_its_module_s_object() -> None:
    for name in oncely.__all__:
        value = getattr(oncely, name)
        if name != "__version__":
            module = importlib.import_module(oncely._EXPORTS[name])
            assert value is getattr(module, name)
    assert oncely.__version__ == importlib.metadata.version("oncely")
