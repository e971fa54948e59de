"""Consoles shared by the commands: results on stdout, progress and diagnostics on stderr; and
the ``--json`` form of a command's result."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator
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


@contextlib.contextmanager
def progress_bar(label: str, *, transient: bool = False) -> Iterator[Callable[[int, int], None]]:
    """Show a progress bar on stderr while the block runs (``transient``: erased at its end);
    yield the ``progress(done, total)`` callback that moves it."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=transient,
    )
    task = bar.add_task("records", total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


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
