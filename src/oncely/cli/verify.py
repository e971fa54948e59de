"""``oncely verify``: reconcile a time window across the outbox, Kafka and the receipts.

Exit codes: 0 nothing lost, stuck, unapplied or out of order; 1 a problem was found, or the
database or Kafka failed; 2 bad arguments.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from oncely.cli._errors import ExitCode
from oncely.cli._imports import load_effects
from oncely.cli._kafka import reached
from oncely.cli._options import (
    BootstrapServers,
    DatabaseUrl,
    RequiredApp,
    parse_duration,
    parse_moment,
)
from oncely.cli._output import JsonFlag, out, print_json, progress_bar
from oncely.ops.verify import Report, verify_window

_REASONS = {
    "topic_missing": "the topic does not exist",
    "missing": "no record of the topic since --since carries its id",
}


app = typer.Typer()


@app.command(name="verify")
def verify(
    since: Annotated[
        str,
        typer.Option(
            help="Window start: ISO-8601 (naive means UTC) or a duration ago (1h).",
            show_default=False,
        ),
    ],
    app: RequiredApp,
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    until: Annotated[
        str | None,
        typer.Option(help="Window end (exclusive; default: now). Same forms as --since."),
    ] = None,
    effect: Annotated[
        list[str] | None,
        typer.Option(help="Check only this effect (repeatable; default: all of the app)."),
    ] = None,
    max_pending_age: Annotated[
        str,
        typer.Option(help="A row not published this long after it was due is stuck (90s, 15m)."),
    ] = "60s",
    show: Annotated[int, typer.Option(help="List at most this many ids per problem.", min=0)] = 20,
    as_json: JsonFlag = False,
) -> None:
    """Reconcile a window of outbox rows with Kafka and the effects' receipts (read-only).

    A row is published once the relay's recorded progress has passed it (and it is not dead or
    held); rows not passed yet are reported as unpublished, which is no problem by itself.
    Problems (exit 1): stuck (not published longer than --max-pending-age after it was due);
    lost (a published row whose id is on no record of its topic, read from --since to the end);
    not applied (published, no receipt of the effect); out of order (a key's event applied
    before the previous one). Rows already purged from the outbox cannot be checked.
    """
    import sqlalchemy as sa

    start = parse_moment(since)
    end = None if until is None else parse_moment(until)
    threshold = parse_duration(max_pending_age).total_seconds()
    effects = load_effects(app)
    chosen = [effects.get(name) for name in effect] if effect else list(effects)
    kafka = reached(bootstrap_servers).client_config()
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with progress_bar("verifying: published rows found in Kafka", transient=True) as progress:
            report = verify_window(
                engine,
                kafka_config=kafka,
                effects=chosen,
                since=start,
                until=end,
                max_pending_age_seconds=threshold,
                limit=show,
                progress=progress,
            )
    finally:
        engine.dispose()
    if as_json:
        print_json(report.to_json())
    else:
        _print(report)
    if not report.ok:
        raise typer.Exit(ExitCode.FAILED)


def _print(report: Report) -> None:
    out.print(
        f"window [{report.since.isoformat()}, {report.until.isoformat()}) of "
        f"{escape(report.database)}"
    )
    summary = Table("check", "count", "", title="verification")
    o = report.outbox
    rows: list[tuple[str, int, bool]] = [
        ("committed events", o.committed, True),
        ("published", o.published, True),
        ("unpublished (not passed by the relay yet)", o.unpublished, True),
        ("dead", o.dead, True),
        ("held (delayed, or behind a parked key)", o.held, True),
        (f"stuck (not published > {report.max_pending_age_seconds:g}s)", o.stuck, o.stuck == 0),
        (f"lost (of {report.checked} published rows checked)", report.lost, report.lost == 0),
    ]
    for e in report.effects:
        rows.append(
            (f"not applied: {e.effect} (of {e.expected})", e.not_applied, not e.not_applied)
        )
        rows.append((f"out of order: {e.effect}", e.out_of_order, not e.out_of_order))
    for label, count, good in rows:
        summary.add_row(escape(label), str(count), "[green]ok[/]" if good else "[red]FAIL[/]")
    out.print(summary)
    for s in report.stuck_rows:
        error = f" error: {escape(s.error)}" if s.error else ""
        out.print(
            f"stuck {s.id} {s.state} for {s.age_seconds:.0f}s in {escape(s.topic)} "
            f"key={escape(s.aggregateid)}{error}"
        )
    for r in report.lost_records:
        out.print(f"lost {r.id} in {escape(r.topic)}: {_REASONS[r.reason]}")
    for e in report.effects:
        for event_id in e.not_applied_ids:
            out.print(f"not applied by {escape(e.effect)}: {event_id}")
        for pair in e.out_of_order_ids:
            out.print(
                f"out of order in {escape(e.effect)}: {pair.id} applied before {pair.previous_id}"
            )
    for note in report.notes:
        out.print(f"[dim]note: {escape(note)}[/]")
    out.print("[green]OK[/]" if report.ok else f"[red]FAILED[/] {report.problems}")
