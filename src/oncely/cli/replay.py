"""``oncely replay``: re-read topics for an effect group, or republish outbox rows.

Exit codes: 0 done (or the dry run printed); 1 the window cannot be republished (purged rows,
parked keys, rows not published yet), records failed, or the database failed; 2 bad arguments.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from oncely.cli._imports import load_effects
from oncely.cli._kafka import reached
from oncely.cli._options import AppOption, parse_moment
from oncely.cli._output import JsonFlag, err, out, print_json, progress_bar
from oncely.consumers.replay import (
    AtOffset,
    AtTime,
    Earliest,
    ReplayError,
    Target,
    execute_reset,
    plan_reset,
    reset_refusal,
)
from oncely.ops.republish import RepublishPlan, plan_republish
from oncely.settings import RelaySettings


def _offset(text: str) -> AtOffset:
    topic, _, rest = text.rpartition(":")
    topic, _, partition = topic.rpartition(":")
    if not topic or not partition.isdigit() or not rest.isdigit():
        raise typer.BadParameter(f"{text!r} is not TOPIC:PARTITION:OFFSET")
    return AtOffset(topic, int(partition), int(rest))


app = typer.Typer()


@app.command(name="replay")
def replay(
    app: AppOption = None,
    effect: Annotated[str | None, typer.Option(help="The effect whose group moves.")] = None,
    to_earliest: Annotated[bool, typer.Option(help="Re-read everything retained.")] = False,
    to_datetime: Annotated[
        str | None,
        typer.Option(help="Re-read from this time (ISO-8601, naive means UTC; or 2h = 2 h ago)."),
    ] = None,
    to_offset: Annotated[
        str | None, typer.Option(help="Move one partition: TOPIC:PARTITION:OFFSET.")
    ] = None,
    from_outbox: Annotated[
        bool,
        typer.Option(
            help="Republish outbox rows to Kafka instead, as the relay sends them (same event "
            "ids and headers), in seq order."
        ),
    ] = False,
    since: Annotated[str | None, typer.Option(help="--from-outbox: rows created since.")] = None,
    until: Annotated[str | None, typer.Option(help="--from-outbox: rows created before.")] = None,
    event_type: Annotated[
        str | None, typer.Option("--type", help="--from-outbox: only this event type.")
    ] = None,
    execute: Annotated[bool, typer.Option(help="Apply the plan (default: dry run).")] = False,
    reason: Annotated[
        str,
        typer.Option(
            help="--from-outbox: why; written with the republish in the audit log (`oncely audit`)."
        ),
    ] = "",
    allow_skip: Annotated[
        bool, typer.Option(help="Allow moving a group forward past records it has not read.")
    ] = False,
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(envvar="ONCELY_KAFKA_BOOTSTRAP_SERVERS", help="Kafka bootstrap servers."),
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(envvar="ONCELY_DATABASE_URL", help="SQLAlchemy URL.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay safely: receipts keep effects single, so re-reading never applies twice.

    Either move an effect group's offsets (--app, --effect and one of --to-earliest,
    --to-datetime, --to-offset; the group must be stopped: the dry run warns while it has
    active members, and says when a killed one stops counting), or republish outbox rows
    (--from-outbox --since T [--until T] [--type X] with --database-url and
    --bootstrap-servers): the rows created in the window are produced again, straight to Kafka,
    through the relay's record path and producer settings (ONCELY_RELAY_*). Refused when rows
    of the window were purged, belong to a parked key (see oncely dead list) or are not
    published yet. Both print the plan and change nothing without --execute.
    """
    if from_outbox:
        _from_outbox(
            database_url,
            bootstrap_servers,
            since,
            until,
            event_type,
            execute=execute,
            reason=reason,
            as_json=as_json,
        )
    else:
        _reset(
            app,
            effect,
            to_earliest,
            to_datetime,
            to_offset,
            bootstrap_servers,
            execute,
            allow_skip=allow_skip,
            as_json=as_json,
        )


def _reset(
    app: str | None,
    effect: str | None,
    to_earliest: bool,
    to_datetime: str | None,
    to_offset: str | None,
    bootstrap_servers: str | None,
    execute: bool,
    *,
    allow_skip: bool,
    as_json: bool,
) -> None:
    chosen = [to_earliest, to_datetime is not None, to_offset is not None]
    if app is None or effect is None or sum(chosen) != 1 or bootstrap_servers is None:
        raise ReplayError(
            "give --app, --effect, --bootstrap-servers and exactly one of --to-earliest, "
            "--to-datetime, --to-offset (or --from-outbox)"
        )
    effects = load_effects(app)
    target: Target
    if to_earliest:
        target = Earliest()
    elif to_datetime is not None:
        target = AtTime(parse_moment(to_datetime))
    else:
        assert to_offset is not None
        target = _offset(to_offset)
    group = effects.group_id(effect)
    config = reached(bootstrap_servers).client_config()
    moves = plan_reset(config, group=group, topics=effects.get(effect).topics, target=target)
    refusal = reset_refusal(config, group)
    members = () if refusal is None else refusal.members
    skipped = sum(m.skips for m in moves)
    total = sum(m.to_reread for m in moves)
    refused = bool(skipped and not allow_skip)
    if as_json:
        print_json(
            {
                "group": group,
                "executed": execute and not refused and refusal is None,
                "to_reread": total,
                "skipped": skipped,
                "active_members": [
                    {"member_id": m.member_id, "client_id": m.client_id, "host": m.host}
                    for m in members
                ],
                "partitions": [
                    {
                        "topic": m.topic,
                        "partition": m.partition,
                        "committed": m.current,
                        "new_offset": m.target,
                        "to_reread": m.to_reread,
                        "skipped": m.skips,
                    }
                    for m in moves
                ],
            }
        )
    table = Table(title=f"group {group}: {'applying' if execute else 'dry run'}")
    for column in ("topic", "partition", "committed", "new offset", "to re-read", "skipped"):
        table.add_column(column)
    for move in moves:
        table.add_row(
            move.topic,
            str(move.partition),
            "-" if move.current is None else str(move.current),
            str(move.target),
            str(move.to_reread),
            f"[red]{move.skips}[/]" if move.skips else "0",
        )
    if not as_json:
        out.print(table)
    if refused:
        raise ReplayError(
            f"this plan moves the group forward past {skipped} record(s) it has not read: "
            "their effects would never apply. Pass --allow-skip if that is what you want."
        )
    if not execute:
        if not as_json:
            out.print(f"dry run: {total} record(s) would be re-read; add --execute to apply")
        if refusal is not None:  # --execute would be refused
            err.print(f"[yellow]warning:[/] {escape(refusal.message)}")
        return
    execute_reset(config, group=group, moves=moves)
    if not as_json:
        out.print(f"moved {len(moves)} partition(s); {total} record(s) will be re-read")


def _from_outbox(
    database_url: str | None,
    bootstrap_servers: str | None,
    since: str | None,
    until: str | None,
    event_type: str | None,
    *,
    execute: bool,
    reason: str,
    as_json: bool,
) -> None:
    import sqlalchemy as sa

    from oncely.ops.actions import Operator, republish_window
    from oncely.relay.publisher import Publisher
    from oncely.relay.service import producer_config

    if database_url is None or since is None or (execute and bootstrap_servers is None):
        raise ReplayError(
            "--from-outbox needs --database-url and --since (and --bootstrap-servers with "
            "--execute)"
        )
    start, end = parse_moment(since), (parse_moment(until) if until else None)
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        if not execute:
            plan = plan_republish(engine, since=start, until=end, event_type=event_type)
            if as_json:
                print_json({"executed": False, "rows": plan.rows, "topics": plan.topics})
                return
            out.print(f"dry run: {plan.rows} row(s) would be republished{_per_topic(plan)}")
            out.print("add --execute to send them (same event ids; receipts absorb the copies)")
            return
        assert bootstrap_servers is not None
        kafka = reached(bootstrap_servers)
        relay = RelaySettings()
        publisher = Publisher(
            producer_config(kafka, relay),
            client=kafka.client_config(),
            cloudevents_source=relay.cloudevents_source,
        )
        with progress_bar("republishing") as progress:
            plan = republish_window(
                engine,
                operator=Operator.of_cli(),
                reason=reason,
                publisher=publisher,
                since=start,
                until=end,
                event_type=event_type,
                progress=progress,
            )
        if as_json:
            print_json({"executed": True, "rows": plan.rows, "topics": plan.topics})
            return
        out.print(f"republished {plan.rows} row(s) with their original event ids{_per_topic(plan)}")
    finally:
        engine.dispose()


def _per_topic(plan: RepublishPlan) -> str:
    if not plan.topics:
        return ""
    return " (" + ", ".join(f"{escape(t)}: {n}" for t, n in sorted(plan.topics.items())) + ")"
