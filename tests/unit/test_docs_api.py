"""The Python API reference (docs/reference/api, rendered by mkdocstrings) documents every public
name, once: each name of ``oncely.__all__`` and of the public packages' ``__all__`` has one
``::: path`` directive on one of its pages. ``make lint`` builds the site strictly, which fails
on a directive that names nothing.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "reference" / "api"
_DIRECTIVE = re.compile(r"^::: (\S+)", re.MULTILINE)

#: The packages whose ``__all__`` is public API; a name ``oncely`` also exports is documented
#: under ``oncely.<name>``.
PUBLIC = ["oncely", "oncely.events", "oncely.producer", "oncely.tasks", "oncely.testing"]


def _directives() -> list[str]:
    return [
        path
        for page in sorted(API.glob("*.md"))
        for path in _DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    ]


def test_every_public_name_is_in_the_api_reference() -> None:
    documented = set(_directives())
    missing = [
        f"{module}.{name}"
        for module in PUBLIC
        for name in importlib.import_module(module).__all__
        if name != "__version__" and not {f"oncely.{name}", f"{module}.{name}"} & documented
    ]
    assert not missing, f"add a `::: ...` directive to a page of docs/reference/api for {missing}"


def _object(path: str) -> object:
    """The module, or the module's attribute, that a directive's path names."""
    module, _, name = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), name)


def test_each_object_is_documented_once() -> None:
    paths: dict[int, list[str]] = {}
    for path in _directives():
        paths.setdefault(id(_object(path)), []).append(path)
    assert not [names for names in paths.values() if len(names) > 1]
