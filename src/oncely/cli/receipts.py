"""``oncely receipts purge``: receipt retention, guarded against unsafe horizons."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from oncely.cli._imports import load_effects
from oncely.cli._kafka import reached
from oncely.cli._options import (
    BootstrapServers,
    DatabaseUrl,
    Execute,
    RequiredApp,
    parse_duration,
)
from oncely.cli._output import JsonFlag, out, print_dry_run, print_json

app = typer.Typer(help="Effect receipts: the evidence that keeps effects single.")


@app.command()
def purge(
    app_: RequiredApp,
    effect: Annotated[str, typer.Option(help="Whose receipts to purge.")],
    older_than: Annotated[str, typer.Option(help="Horizon, e.g. 30d.")],
    database_url: DatabaseUrl,
    bootstrap_servers: BootstrapServers,
    force: Annotated[
        bool, typer.Option(help="Purge even within the topics' retention (unsafe).")
    ] = False,
    execute: Execute = False,
    as_json: JsonFlag = False,
) -> None:
    """Delete an effect's receipts older than --older-than, in batches.

    A dry run unless --execute: it prints how many receipts it would delete and the oldest
    one's time, and deletes nothing. Refused (exit 1), even as a dry run, when the horizon is
    shorter than the retention of the effect's topics (a replay could then apply an event
    twice) unless --force.
    """
    import sqlalchemy as sa
    from confluent_kafka.admin import AdminClient

    from oncely.consumers.receipts import (
        check_horizon,
        preview_receipts,
        purge_receipts,
        topic_retention,
    )

    horizon = parse_duration(older_than)
    declared = load_effects(app_).get(effect)
    admin = AdminClient(reached(bootstrap_servers).client_config())
    retention = topic_retention(admin, declared.topics)
    check_horizon(horizon, retention, force=force)
    engine = sa.create_engine(database_url)
    try:
        if not execute:
            preview = preview_receipts(engine, effect=effect, older_than=horizon)
            if as_json:
                print_json({"executed": False, "effect": effect, **asdict(preview)})
                return
            oldest = preview.oldest_applied_at
            out.print(
                f"would delete {preview.receipts} receipt(s) of {effect} older than {older_than}"
                + (f", oldest applied {oldest.isoformat()}" if oldest is not None else "")
            )
            print_dry_run()
            return
        deleted = purge_receipts(
            engine, effect=effect, older_than=horizon, retention=retention, force=force
        )
    finally:
        engine.dispose()
    if as_json:
        print_json({"executed": True, "effect": effect, "receipts": deleted})
        return
    out.print(f"deleted {deleted} receipt(s) of {effect} older than {older_than}")
