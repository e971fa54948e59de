"""The schema catalog: the committed contract, ``<dir>/<event-type>/v<N>.avsc``.

Each file holds one version of one event type's Avro schema in the stable form of
:func:`oncely.events.canonical.dump_avsc`. A committed version is never rewritten: a changed
schema gets a new version, and ``oncely schemas check`` proves it compatible with the old ones.
The catalog answers two questions: the schema of (event type, version), and which schema a
single-object fingerprint names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from fastavro.schema import SchemaParseException, parse_schema

from oncely.events import EventType
from oncely.events.canonical import dump_avsc, fingerprint
from oncely.schemas.errors import CatalogError, CommittedVersionChangedError

__all__ = ["FileChange", "SchemaCatalog", "SchemaEntry", "export_schemas", "schema_path"]

_VERSION_FILE = re.compile(r"v([1-9][0-9]*)\.avsc")


@dataclass(frozen=True, slots=True)
class SchemaEntry:
    """One version of one event type's schema. Do not mutate ``schema``.

    ``source`` is the file it was loaded from, or ``None`` when it comes from the code.
    """

    event_type: str
    version: int
    schema: dict[str, Any]
    fingerprint: bytes
    source: Path | None = None

    @classmethod
    def of(cls, event_type: EventType[Any]) -> SchemaEntry:
        """Return the entry of the code's schema of ``event_type``."""
        return cls(
            event_type=event_type.name,
            version=event_type.version,
            schema=event_type.schema,
            fingerprint=event_type.fingerprint,
        )

    def describe(self) -> str:
        """Name the entry for messages: its file, or ``<type> v<N> (code)``."""
        return str(self.source) if self.source else f"{self.event_type} v{self.version} (code)"


def schema_path(directory: Path, event_type: str, version: int) -> Path:
    """Return the path of ``event_type`` version ``version`` in the catalog ``directory``."""
    return directory / event_type / f"v{version}.avsc"


class SchemaCatalog:
    """Schema versions of event types, looked up by (type, version) or by fingerprint."""

    def __init__(
        self, entries: Iterable[SchemaEntry] = (), *, directory: Path | None = None
    ) -> None:
        """Build a catalog from ``entries``; ``directory`` is the folder they were loaded from
        (named in decoding errors), ``None`` for a catalog built in code.

        Raises:
            CatalogError: two entries have the same event type and version.
        """
        self.directory = directory
        self._entries: dict[tuple[str, int], SchemaEntry] = {}
        self._by_fingerprint: dict[bytes, SchemaEntry] = {}
        for entry in sorted(entries, key=lambda item: (item.event_type, item.version)):
            if (entry.event_type, entry.version) in self._entries:
                raise CatalogError(
                    f"{entry.describe()} duplicates "
                    f"{self._entries[entry.event_type, entry.version].describe()}"
                )
            self._entries[entry.event_type, entry.version] = entry
            self._by_fingerprint[entry.fingerprint] = entry  # a later version wins a tie

    @classmethod
    def load(cls, directory: str | Path) -> SchemaCatalog:
        """Load every ``<event-type>/v<N>.avsc`` below ``directory``.

        Files that do not end in ``.avsc`` are ignored.

        Raises:
            CatalogError: the directory is missing, or a file is misnamed, is not JSON or is not
                a valid Avro schema; the message names the file.
        """
        root = Path(directory)
        if not root.is_dir():
            raise CatalogError(
                f"schema catalog directory {root} does not exist: give the folder "
                "`oncely schemas export` writes (<event-type>/v<N>.avsc)"
            )
        entries = [_load_entry(path) for path in sorted(root.glob("*/*.avsc"))]
        return cls(entries, directory=root.absolute())

    def find(self, event_type: str, version: int) -> SchemaEntry | None:
        """Return the entry of ``event_type`` version ``version``, or ``None``."""
        return self._entries.get((event_type, version))

    def by_fingerprint(self, fingerprint: bytes) -> SchemaEntry | None:
        """Return the entry whose canonical form has ``fingerprint``, or ``None``.

        Versions that differ only in docs, defaults or logical types share a fingerprint; the
        latest of them is returned (they parse data identically).
        """
        return self._by_fingerprint.get(fingerprint)

    def versions(self, event_type: str) -> list[SchemaEntry]:
        """Return the entries of ``event_type``, oldest version first."""
        return [entry for (name, _), entry in self._entries.items() if name == event_type]

    def event_types(self) -> list[str]:
        """Return the event types that have at least one version, sorted."""
        return sorted({name for name, _ in self._entries})

    def __iter__(self) -> Iterator[SchemaEntry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def _load_entry(path: Path) -> SchemaEntry:
    match = _VERSION_FILE.fullmatch(path.name)
    if match is None:
        raise CatalogError(f"{path}: schema files are named v<N>.avsc (N >= 1)")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
        parse_schema(schema)
        schema_fingerprint = fingerprint(schema)
    except (SchemaParseException, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CatalogError(f"{path}: not a valid Avro schema: {exc}") from exc
    return SchemaEntry(
        event_type=path.parent.name,
        version=int(match.group(1)),
        schema=schema,
        fingerprint=schema_fingerprint,
        source=path,
    )


class FileChange(StrEnum):
    """What :func:`export_schemas` did with one schema file."""

    WRITTEN = "written"
    UNCHANGED = "unchanged"


def export_schemas(
    event_types: Iterable[EventType[Any]], directory: Path
) -> list[tuple[Path, FileChange]]:
    """Write each event type's current schema to ``<directory>/<type>/v<N>.avsc``.

    All-or-nothing: files are only written if no committed version would change.

    Raises:
        CommittedVersionChangedError: an existing file holds different content for its version
            (the message names each such file: bump the version, or revert the model).
    """
    plan = [
        (schema_path(directory, event_type.name, event_type.version), dump_avsc(event_type.schema))
        for event_type in event_types
    ]
    conflicts = [
        path for path, text in plan if path.exists() and path.read_text(encoding="utf-8") != text
    ]
    if conflicts:
        raise CommittedVersionChangedError(
            "refusing to rewrite committed schema versions: "
            + ", ".join(str(path) for path in conflicts)
            + "; a changed schema needs a new version (bump version=... in the declaration)"
        )
    outcomes = []
    for path, text in plan:
        if path.exists():
            outcomes.append((path, FileChange.UNCHANGED))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        outcomes.append((path, FileChange.WRITTEN))
    return outcomes
