"""Consoles shared by the commands: results on stdout, progress and diagnostics on stderr; and
the ``--json`` form of a command's result."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from oncely.storage.stores.outbox.rows import TopicPurge

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

#: The last line of every destructive command's dry run (stdout).
DRY_RUN = "dry run: nothing changed; run again with {flag} to do it"

JsonFlag = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print the result as one JSON document on stdout instead, for machines (field "
        "names as in the metrics; the exit status is the same).",
    ),
]


def print_dry_run(flag: str = "--execute") -> None:
    """Say that nothing was changed, and which flag makes the change."""
    out.print(DRY_RUN.format(flag=flag))


def print_topic_purges(heading: str, topics: Iterable[TopicPurge]) -> None:
    """Print ``heading``, then a line per topic of the outbox rows a purge deletes: how many, and
    the oldest of them."""
    out.print(heading)
    for topic in topics:
        out.print(
            f"  {escape(topic.topic)}: {topic.rows} row(s), oldest {topic.oldest_id} created "
            f"{topic.oldest_created_at.isoformat()}"
        )


def print_json(document: dict[str, Any]) -> None:
    """Write ``document`` to stdout as indented JSON (dataclasses as objects; times in
    ISO-8601, UUIDs as text)."""
    sys.stdout.write(json.dumps(to_jsonable_python(document), indent=2) + "\n")
