"""A Griffe extension for the API reference (mkdocs.yml): oncely's docstrings are plain prose
with Sphinx cross-reference roles (``:class:`Registry```, ``:func:`~oncely.tasks.enqueue_task```),
which Markdown would print as they are. Each role becomes the target's name in code, linked
when the target is on the site (an optional autoref), and a target that names nothing in the
package is a warning, so ``mkdocs build --strict`` fails on a stale reference. A paragraph
ending in ``::`` (reStructuredText's "a code block follows") ends in ``:``, and a ``::`` after a
space or alone on its line goes.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterator
from typing import Any

from griffe import (
    AliasResolutionError,
    CyclicAliasError,
    Extension,
    GriffeLoader,
    Module,
    NameResolutionError,
    Object,
    get_logger,
)

_logger = get_logger("griffe_roles")

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(?P<target>[^`]+)`")
_LITERAL_BLOCK = re.compile(r"(?P<space>^|\s)?::$", re.MULTILINE)


class SphinxRoles(Extension):
    """Rewrites the roles of every docstring of the packages named in ``packages``."""

    def __init__(self, packages: list[str]) -> None:
        super().__init__()
        self.packages = set(packages)

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in self.packages:
            return
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj, obj.docstring.value, loader)

    def _rewrite(self, obj: Object, text: str, loader: GriffeLoader) -> str:
        text = _ROLE.sub(lambda match: self._link(obj, match["target"], loader), text)
        return _LITERAL_BLOCK.sub(lambda match: "" if match["space"] is not None else ":", text)

    def _link(self, obj: Object, target: str, loader: GriffeLoader) -> str:
        shown = target.lstrip("~.")
        if target.startswith("~"):
            shown = shown.rsplit(".", 1)[-1]
        path = _resolve(obj, target.lstrip("~"), loader)
        if path is None:
            _logger.warning(f"{obj.path}: the docstring's reference {target!r} names nothing")
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional>`{shown}`</autoref>'


def _resolve(obj: Object, target: str, loader: GriffeLoader) -> str | None:
    """The path ``target`` names as Sphinx would look it up from ``obj``'s docstring: in the
    scope of ``obj`` and its parents (imports included), else as a full path; ``.name`` is
    ``name`` in ``obj``'s module or a package above it, else the one object of the package
    whose path ends with it. A path outside the loaded packages (another library's) is taken
    as it is."""
    if target.startswith("."):
        package: Object | None = obj.module
        candidates = []
        while package is not None:
            candidates.append(f"{package.path}{target}")
            package = package.parent
        suffixed = [other.path for other in _objects(obj.package) if other.path.endswith(target)]
        candidates += suffixed if len(suffixed) == 1 else []
    else:
        head, _, rest = target.partition(".")
        candidates = [target]
        scope: Object | None = obj
        while scope is not None:
            try:
                found = scope.resolve(head)
            except NameResolutionError:
                scope = scope.parent
            else:
                candidates.insert(0, f"{found}.{rest}" if rest else found)
                break
    for path in candidates:
        if "." not in path and path not in loader.modules_collection:
            return path if hasattr(builtins, path) else None
        if path.split(".", 1)[0] not in loader.modules_collection:
            return path  # another library's object: not checked
        try:
            return loader.modules_collection[path].canonical_path
        except (KeyError, AliasResolutionError, CyclicAliasError):
            pass  # not this candidate
    return None


def _objects(obj: Object) -> Iterator[Object]:
    """``obj`` and every object defined in it (not the names it imports), depth first."""
    yield obj
    for member in obj.members.values():
        if isinstance(member, Object):
            yield from _objects(member)
