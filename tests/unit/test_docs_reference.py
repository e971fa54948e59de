"""The generated reference pages are current, and every `oncely` command line in the docs exists.

When a test here fails after a CLI or settings change, regenerate with
``python -m tools.gen_reference`` (from the repository root) and commit docs/reference/.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from tools import gen_reference

from oncely.cli import app

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SHELL = {"", "sh", "bash", "shell", "console"}
_COMMAND_START = re.compile(r"^\s*(?:\$\s+)?(?:\S*/)?oncely(?:\s|$)")


def test_reference_pages_match_a_fresh_generation(tmp_path: Path) -> None:
    gen_reference.write(tmp_path)
    generated = sorted(path.name for path in tmp_path.iterdir())
    assert generated == ["cli.md", "settings.md"]
    problems = []
    for name in generated:
        committed = REFERENCE / name
        fresh = (tmp_path / name).read_text(encoding="utf-8")
        if not committed.exists():
            problems.append(f"docs/reference/{name} is missing")
            continue
        current = committed.read_text(encoding="utf-8")
        if current != fresh:
            diff = difflib.unified_diff(
                current.splitlines(),
                fresh.splitlines(),
                f"docs/reference/{name} (committed)",
                f"docs/reference/{name} (generated)",
                lineterm="",
            )
            problems.append("\n".join(list(diff)[:60]))
    if problems:
        pytest.fail(
            "docs/reference is stale: run `python -m tools.gen_reference` from the repository "
            "root and commit the result.\n\n" + "\n\n".join(problems),
            pytrace=False,
        )


def test_generation_is_deterministic_and_location_free() -> None:
    first, second = gen_reference.render_all(), gen_reference.render_all()
    assert first == second
    for name, text in first.items():
        assert str(ROOT) not in text, f"{name} contains the checkout path"
        assert str(Path.home()) not in text, f"{name} contains the home directory"


def test_check_mode_names_stale_pages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gen_reference.main(["--out", str(tmp_path), "--check"]) == 1
    assert "python -m tools.gen_reference" in capsys.readouterr().err
    assert gen_reference.main(["--out", str(tmp_path)]) == 0
    assert gen_reference.main(["--out", str(tmp_path), "--check"]) == 0


def test_every_settings_field_and_command_is_documented() -> None:
    settings_page = (REFERENCE / "settings.md").read_text(encoding="utf-8")
    for variable in gen_reference.settings_env_vars():
        assert f"`{variable}`" in settings_page
    cli_page = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    root = typer.main.get_command(app)
    for name in root.commands:  # type: ignore[attr-defined]
        assert f"## oncely {name}\n" in cli_page


# -- command lines in the docs ----------------------------------------------------------------


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _command_lines(text: str) -> Iterator[str]:
    """Every `oncely ...` line of the shell blocks, continuation lines joined."""
    for match in _FENCE.finditer(text):
        info = match.group(1).strip().split()
        if (info[0] if info else "") not in _SHELL:
            continue
        body = match.group(2).replace("\\\n", " ")
        for line in body.splitlines():
            if _COMMAND_START.match(line):
                yield line


def _check_line(root: Any, line: str) -> str | None:
    """``None`` if the command and options exist, else what is wrong."""
    tokens = shlex.split(line, comments=True)
    while tokens and not tokens[0].endswith("oncely"):
        tokens.pop(0)  # a "$ " prompt
    command, path = root, ["oncely"]
    for token in tokens[1:]:
        if token in {"|", "&&", "||", ";", "&"} or token.startswith(("$(", ">", "<", "2>")):
            break
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
            if name != "--help" and name not in known:
                return f"`{' '.join(path)}` has no option {name}"
            continue
        children = getattr(command, "commands", None)
        if children and not token.startswith("-"):
            if token not in children:
                return f"`{' '.join(path)}` has no command {token!r}"
            command, path = children[token], [*path, token]
    return None


def test_oncely_command_lines_in_the_docs_exist() -> None:
    root = typer.main.get_command(app)
    problems, seen = [], 0
    for path in _doc_files():
        for line in _command_lines(path.read_text(encoding="utf-8")):
            seen += 1
            problem = _check_line(root, line)
            if problem:
                problems.append(f"{path.relative_to(ROOT)}: {line.strip()}\n    {problem}")
    assert seen > 20, "the docs were expected to show oncely commands"
    assert not problems, "\n".join(problems)


def test_the_command_line_checker_catches_mistakes() -> None:
    root = typer.main.get_command(app)
    assert _check_line(root, "oncely relay run --metrics-port 9400") is None
    assert _check_line(root, "$ .venv/bin/oncely dead requeue --all  # unpark") is None
    assert "no option --nope" in (_check_line(root, "oncely relay run --nope") or "")
    assert "no command 'rn'" in (_check_line(root, "oncely relay rn") or "")
