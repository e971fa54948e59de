"""``oncely schemas export|check`` run as a user would, in subprocesses.

Run as ``python -m oncely schemas``, as a user's CI would run ``oncely schemas``.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import oncely_process

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).parents[2]
NO_DEFAULT = "reader_field_missing_default_value"

HEADER = """
from decimal import Decimal
from typing import Annotated
from uuid import UUID

from pydantic import BaseModel, Field

from oncely.events import Registry

registry = Registry(topic_prefix="shop.")
"""

V1 = """
@registry.event("order.placed", key="order_id", aggregate="order", version={version})
class OrderPlaced(BaseModel):
    order_id: UUID
    customer: str
    total: Annotated[Decimal, Field(max_digits=10, decimal_places=2)]
"""

CHANGES = {
    "v1": V1,
    "added_optional": V1 + "    note: str | None = None\n",
    "added_required": V1 + "    channel: str\n",
    "removed_required": V1.replace("    customer: str\n", ""),
    "changed_type": V1.replace("customer: str", "customer: int"),
    "changed_scale": V1.replace("decimal_places=2", "decimal_places=3"),
}


def write_app(directory: Path, change: str, version: int) -> None:
    source = HEADER + CHANGES[change].format(version=version)
    (directory / "shop_events.py").write_text(textwrap.dedent(source))


def oncely_schemas(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return oncely_process("schemas", *args, cwd=directory, timeout=60)


def export(directory: Path) -> subprocess.CompletedProcess[str]:
    return oncely_schemas(directory, "export", "--registry", "shop_events:registry", "--out", "s")


def check(directory: Path, mode: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return oncely_schemas(
        directory, "check", "--registry", "shop_events:registry", "--dir", "s", "--mode", mode,
        *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def exported_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The app at v1 and the catalog ``oncely schemas export`` wrote for it, made once."""
    directory = tmp_path_factory.mktemp("v1")
    write_app(directory, "v1", 1)
    result = export(directory)
    assert result.returncode == 0, result.stderr
    return directory


@pytest.fixture
def committed_v1(exported_v1: Path, tmp_path: Path) -> Path:
    """A copy of ``exported_v1`` for this test to change (without Python's bytecode cache: a
    rewritten ``shop_events.py`` of the same size could look unchanged to it)."""
    directory = tmp_path / "app"
    shutil.copytree(exported_v1, directory, ignore=shutil.ignore_patterns("__pycache__"))
    return directory


def test_export_writes_then_leaves_files_unchanged(committed_v1: Path) -> None:
    schema = committed_v1 / "s" / "order.placed" / "v1.avsc"
    assert schema.is_file()
    assert '"namespace": "order.placed"' in schema.read_text()
    again = export(committed_v1)
    assert again.returncode == 0
    assert "unchanged s/order.placed/v1.avsc" in again.stdout


def test_export_refuses_to_rewrite_a_committed_version(committed_v1: Path) -> None:
    schema = committed_v1 / "s" / "order.placed" / "v1.avsc"
    before = schema.read_text()
    write_app(committed_v1, "added_optional", 1)
    result = export(committed_v1)
    assert result.returncode == 1
    assert "s/order.placed/v1.avsc" in result.stderr
    assert "refusing to rewrite" in result.stderr
    assert schema.read_text() == before


def test_export_adds_a_new_version(committed_v1: Path) -> None:
    write_app(committed_v1, "added_optional", 2)
    result = export(committed_v1)
    assert result.returncode == 0, result.stderr
    assert "written   s/order.placed/v2.avsc" in result.stdout


@pytest.mark.parametrize("mode", ["BACKWARD", "FORWARD", "FULL", "full"])
def test_added_optional_field_is_compatible(committed_v1: Path, mode: str) -> None:
    write_app(committed_v1, "added_optional", 2)
    result = check(committed_v1, mode)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    order.placed v2 (v1)" in result.stdout


@pytest.mark.parametrize(
    ("change", "mode", "breaks"),
    [
        ("added_required", "BACKWARD", [f"{NO_DEFAULT} at /fields/3: channel"]),
        ("added_required", "FORWARD", []),
        ("added_required", "FULL", [f"{NO_DEFAULT} at /fields/3: channel"]),
        ("removed_required", "BACKWARD", []),
        ("removed_required", "FORWARD", [f"{NO_DEFAULT} at /fields/1: customer"]),
        ("removed_required", "FULL", [f"{NO_DEFAULT} at /fields/1: customer"]),
        ("changed_type", "BACKWARD", ["v2 (code) cannot read v1: type_mismatch at /fields/1/type"]),
        ("changed_type", "FORWARD", ["v1 cannot read v2 (code): type_mismatch at /fields/1/type"]),
        ("changed_type", "FULL", ["v2 (code) cannot read v1: type_mismatch at /fields/1/type",
                                  "v1 cannot read v2 (code): type_mismatch at /fields/1/type"]),
        ("changed_scale", "BACKWARD", ["decimal_mismatch at /fields/2/type"]),
    ],
)  # fmt: skip
def test_breaking_changes_are_reported_per_mode(
    committed_v1: Path, change: str, mode: str, breaks: list[str]
) -> None:
    write_app(committed_v1, change, 2)
    result = check(committed_v1, mode)
    reported = [line for line in result.stdout.splitlines() if line.startswith("BREAK")]
    assert len(reported) == len(breaks), result.stdout
    for line, expected in zip(reported, breaks, strict=True):
        assert line.startswith("BREAK order.placed: ")
        assert expected in line
    assert result.returncode == (1 if breaks else 0), result.stdout + result.stderr
    if breaks:
        assert f"incompatibilities ({mode}" in result.stderr


def test_transitive_compares_with_every_older_version(committed_v1: Path) -> None:
    write_app(committed_v1, "removed_required", 2)
    assert check(committed_v1, "BACKWARD").returncode == 0
    assert export(committed_v1).returncode == 0
    # v3 brings "customer" back as required: fine after v2 in FORWARD, not after v1 ... and
    # BACKWARD: v3 cannot read v2 data (no customer, no default) -> a break either way.
    write_app(committed_v1, "v1", 3)
    assert check(committed_v1, "FORWARD").returncode == 0
    transitive = check(committed_v1, "FORWARD", "--transitive")
    assert transitive.returncode == 0
    backward = check(committed_v1, "BACKWARD")
    assert backward.returncode == 1
    assert "v3 (code) cannot read v2" in backward.stdout
    write_app(committed_v1, "removed_required", 3)
    assert check(committed_v1, "FORWARD").returncode == 0
    transitive = check(committed_v1, "FORWARD", "--transitive")
    assert transitive.returncode == 1
    assert "v1 cannot read v3 (code)" in transitive.stdout


def test_changing_a_committed_version_is_a_break(committed_v1: Path) -> None:
    write_app(committed_v1, "added_optional", 1)
    result = check(committed_v1, "BACKWARD")
    assert result.returncode == 1
    assert "committed_version_changed" in result.stdout


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nowhere_at_all:registry", "cannot import module 'nowhere_at_all'"),
        ("shop_events:missing", "has no attribute 'missing'"),
        ("shop_events:OrderPlaced", "name an oncely.App"),
        ("shop_events", "not of the form"),
    ],
)
def test_bad_registry_target_cannot_run(committed_v1: Path, target: str, message: str) -> None:
    result = oncely_schemas(committed_v1, "check", "--registry", target, "--dir", "s")
    assert result.returncode == 2
    assert message in result.stderr


def test_missing_catalog_cannot_run(committed_v1: Path) -> None:
    result = oncely_schemas(
        committed_v1, "check", "--registry", "shop_events:registry", "--dir", "nope"
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_the_examples_committed_contract_checks_clean() -> None:
    result = oncely_schemas(
        REPO, "check", "--registry", "examples.payments.events:registry", "--dir", "schemas",
        "--mode", "FULL", "--transitive",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok    transfer.completed v2 (v1, v2)" in result.stdout
