"""The console's pages and actions as one FastAPI router, and a standalone app around it.

:meth:`Console.router` is what a FastAPI service mounts under its own path and behind its own
auth dependency (``app.include_router(console.router(authenticate=current_user), prefix=
"/oncely")``); :meth:`Console.app` is what ``oncely web`` serves, behind Basic auth. Pages are
rendered on the server (Jinja2); htmx refreshes the overview's figures in place. Everything
reads through :mod:`oncely.ops` and the stores, and every action goes through
:mod:`oncely.ops.actions`, as the CLI does: a dry run shows what it would change, the POST
carries it out and writes the audit entry. With ``read_only`` the action routes do not exist.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Annotated, Any
from uuid import UUID

import sqlalchemy as sa
from confluent_kafka import KafkaException
from fastapi import APIRouter, Depends, FastAPI, Form, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, select_autoescape

from oncely.consumers.completeness import EffectCompleteness
from oncely.consumers.effects import Effects
from oncely.durations import parse_moment
from oncely.errors import OncelyError
from oncely.ops import actions, lookup, throughput
from oncely.ops.republish import plan_republish
from oncely.ops.status import ShardStatus, Status, collect_status
from oncely.schemas.codec import Codec
from oncely.settings import CompletenessSettings, KafkaSettings, RelaySettings, WebSettings
from oncely.storage.stores import audit, dead_lettered
from oncely.storage.stores.outbox import dead
from oncely.storage.stores.outbox import lookup as rows
from oncely.tasks.store import TaskStore
from oncely.web.auth import Authenticate, Csrf

#: Seconds the overview waits for Kafka's answers at each refresh.
KAFKA_SECONDS = 3.0
VERBS = ("requeue", "skip", "reclaim", "republish")
_STATIC = {"htmx.min.js": "text/javascript", "console.css": "text/css"}


@dataclass
class _Rate:
    """The publish rate: the change of the topics' record count between two refreshes."""

    last: tuple[float, int] | None = None

    def sample(self, count: int | None) -> float | None:
        if count is None:
            self.last = None
            return None
        now = time.monotonic()
        previous, self.last = self.last, (now, count)
        if previous is None or now <= previous[0]:
            return None
        return max(0.0, (count - previous[1]) / (now - previous[0]))


@dataclass
class _Completeness:
    """The last completeness figures: checked at most every interval (a check reads the
    window's rows), shown at every refresh in between."""

    figures: list[EffectCompleteness] = field(default_factory=list)
    at: float | None = None

    def due(self, interval: float) -> bool:
        return self.at is None or time.monotonic() - self.at >= max(interval, 1.0)

    def kept(self, status: Status, *, checked: bool) -> Status:
        if checked:
            self.figures, self.at = status.completeness, time.monotonic()
            return status
        return replace(status, completeness=self.figures)


@dataclass
class Console:
    """What the console shows and acts on: the database behind ``engine``; the application's
    ``effects`` (names, groups, topics) and ``codec`` (to decode payloads), when given; Kafka,
    when ``kafka`` is given (lag, DLQ depth, publish rate, an event's record, republish, with
    ``relay``'s producer settings). The effects' completeness is checked as ``completeness``
    says, at most every ``completeness.interval_seconds`` (at least every second).
    ``app_target`` names the application in the commands the pages suggest."""

    engine: sa.Engine
    settings: WebSettings = field(default_factory=WebSettings)
    effects: Effects | None = None
    codec: Codec | None = None
    kafka: KafkaSettings | None = None
    relay: RelaySettings | None = None
    completeness: CompletenessSettings = field(default_factory=CompletenessSettings)
    app_target: str = "<module:app>"
    _rate: _Rate = field(default_factory=_Rate, init=False, repr=False)
    _completeness: _Completeness = field(
        default_factory=lambda: _Completeness(), init=False, repr=False
    )
    _csrf: Csrf = field(default_factory=Csrf, init=False, repr=False)
    _templates: Jinja2Templates = field(
        default_factory=lambda: _templates(), init=False, repr=False
    )

    def app(self, authenticate: Authenticate) -> FastAPI:
        """A standalone ASGI app serving :meth:`router` at ``/``."""
        application = FastAPI(
            title="oncely console", docs_url=None, redoc_url=None, openapi_url=None
        )
        application.include_router(self.router(authenticate))
        return application

    def router(self, authenticate: Authenticate) -> APIRouter:
        """Every page (and, unless ``settings.read_only``, every action), each behind
        ``authenticate``: a FastAPI dependency returning the operator's name."""
        router = APIRouter()
        auth = Depends(authenticate)
        page = self._page

        @router.get("/", name="overview", response_class=HTMLResponse)
        def overview(request: Request, operator: str = auth) -> HTMLResponse:
            return page(request, operator, "overview.html", **self._figures())

        @router.get("/figures", name="figures", response_class=HTMLResponse)
        def figures(request: Request, operator: str = auth) -> HTMLResponse:
            return page(request, operator, "_figures.html", **self._figures())

        @router.get("/events", name="events", response_class=HTMLResponse)
        def events(
            request: Request, q: Annotated[str, Query()] = "", operator: str = auth
        ) -> Response:
            q = q.strip()
            try:
                event_id = UUID(q)
            except ValueError:
                found = lookup.lookup_key(self.engine, q) if q else []
                return page(request, operator, "events.html", q=q, found=found)
            return RedirectResponse(request.url_for("event", event_id=str(event_id)), 303)

        @router.get("/events/{event_id}", name="event", response_class=HTMLResponse)
        def event(request: Request, event_id: UUID, operator: str = auth) -> HTMLResponse:
            seen = lookup.lookup_event(
                self.engine,
                event_id,
                effects=self.effects,
                codec=self.codec,
                kafka_config=self.kafka.client_config() if self.kafka else None,
                timeout=KAFKA_SECONDS,
            )
            if seen is None:
                return page(
                    request, operator, "event.html", seen=None, event_id=event_id, status_code=404
                )
            return page(
                request,
                operator,
                "event.html",
                seen=seen,
                event_id=event_id,
                payload=self._payload(seen.event, seen.decoded),
            )

        @router.get("/parked", name="parked", response_class=HTMLResponse)
        def parked(request: Request, operator: str = auth) -> HTMLResponse:
            listed = dead.list_dead(self.engine, delayed=True)
            with self.engine.connect() as conn:
                stored = {row.id: rows.event(conn, row.id) for row in listed[:_LISTED]}
                letters = dead_lettered.unapplied(conn, limit=_LISTED)
            payloads = {
                event_id: self._payload(row, lookup.decoded_payload(row, self.codec)[0])
                for event_id, row in stored.items()
                if row is not None
            }
            return page(
                request,
                operator,
                "parked.html",
                listed=listed,
                payloads=payloads,
                letters=letters,
                app_target=self.app_target,
            )

        @router.get("/tasks", name="tasks", response_class=HTMLResponse)
        def tasks(request: Request, operator: str = auth) -> HTMLResponse:
            store = TaskStore(engine=self.engine)
            listed = store.list_tasks(status="dead", limit=_LISTED)
            listed += store.list_tasks(status="failed", limit=_LISTED)
            listed += store.list_tasks(status="stale", limit=_LISTED)
            return page(request, operator, "tasks.html", listed=listed)

        @router.get("/audit", name="audit", response_class=HTMLResponse)
        def audit_log(
            request: Request,
            done: Annotated[str | None, Query()] = None,
            changed: Annotated[int | None, Query()] = None,
            operator: str = auth,
        ) -> HTMLResponse:
            with self.engine.connect() as conn:
                entries = audit.entries(conn, limit=_LISTED)
            return page(
                request, operator, "audit.html", entries=entries, done=done, changed=changed
            )

        @router.get("/static/{name}", name="static")
        def static(name: str) -> Response:
            if name not in _STATIC:
                raise HTTPException(404)
            body = resources.files(__package__).joinpath("static", name).read_bytes()
            return Response(
                body, media_type=_STATIC[name], headers={"Cache-Control": "max-age=3600"}
            )

        if not self.settings.read_only:
            self._actions(router, auth)
        return router

    def _page(
        self,
        request: Request,
        operator: str,
        name: str,
        status_code: int = 200,
        **context: Any,
    ) -> HTMLResponse:
        response: HTMLResponse = self._templates.TemplateResponse(
            request,
            name,
            {
                "operator": operator,
                "read_only": self.settings.read_only,
                "csrf": self._csrf.token(operator),
                "refresh": self.settings.refresh_seconds,
                **context,
            },
            status_code=status_code,
        )
        return response

    def _actions(self, router: APIRouter, auth: Any) -> None:
        """The dry run (GET) and the execution (POST) of each action."""
        page = self._page

        @router.get("/actions/{verb}", name="plan", response_class=HTMLResponse)
        def plan(
            request: Request,
            verb: str,
            ids: Annotated[list[UUID], Query(alias="id")] = [],  # noqa: B006 - FastAPI's form
            topic: Annotated[str | None, Query()] = None,
            task: Annotated[UUID | None, Query()] = None,
            since: Annotated[str | None, Query()] = None,
            until: Annotated[str | None, Query()] = None,
            event_type: Annotated[str | None, Query(alias="type")] = None,
            operator: str = auth,
        ) -> HTMLResponse:
            asked = _Asked(
                verb, ids, topic or None, task, since or None, until or None, event_type or None
            )
            try:
                count, would = self._plan(asked)
            except (OncelyError, ValueError) as exc:
                return page(
                    request, operator, "plan.html", asked=asked, error=str(exc), status_code=409
                )
            return page(
                request, operator, "plan.html", asked=asked, count=count, would=would, error=None
            )

        @router.post("/actions/{verb}", name="execute")
        def execute(
            request: Request,
            verb: str,
            reason: Annotated[str, Form()],
            csrf: Annotated[str, Form()] = "",
            ids: Annotated[list[UUID], Form(alias="id")] = [],  # noqa: B006 - FastAPI's form
            topic: Annotated[str | None, Form()] = None,
            task: Annotated[UUID | None, Form()] = None,
            since: Annotated[str | None, Form()] = None,
            until: Annotated[str | None, Form()] = None,
            event_type: Annotated[str | None, Form(alias="type")] = None,
            operator: str = auth,
        ) -> Response:
            self._csrf.check(request, operator, csrf)
            asked = _Asked(
                verb, ids, topic or None, task, since or None, until or None, event_type or None
            )
            if not reason.strip():
                raise HTTPException(400, detail="give a reason: it is written in the audit log")
            try:
                changed = self._execute(asked, actions.Operator(operator, "web"), reason.strip())
            except (OncelyError, ValueError) as exc:
                return page(
                    request, operator, "plan.html", asked=asked, error=str(exc), status_code=409
                )
            target = request.url_for("audit").include_query_params(done=verb, changed=changed)
            return RedirectResponse(target, 303)

    def _plan(self, asked: _Asked) -> tuple[int, list[str]]:
        """How many rows (or tasks) ``asked`` would change, and a line for each (per topic, for
        a republish); raises when it cannot be done."""
        if asked.verb in ("requeue", "skip"):
            if asked.verb == "skip" and not asked.ids:
                raise ValueError("name the rows to skip")
            found = (
                actions.plan_skip(self.engine, ids=asked.ids)
                if asked.verb == "skip"
                else actions.plan_requeue(self.engine, ids=asked.ids or None, topic=asked.topic)
            )
            return len(found), [
                f"{r.id} {r.topic} key={r.aggregateid} {r.reason}, {r.held} held" for r in found
            ]
        if asked.verb == "reclaim":
            record = actions.plan_reclaim(self.engine, asked.task_id())
            return 1, [
                f"task {record.id} {record.name} ({record.status}, {record.attempts} attempts)"
            ]
        if asked.verb == "republish":
            since, until = asked.window()
            planned = plan_republish(
                self.engine, since=since, until=until, event_type=asked.event_type
            )
            return planned.rows, [f"{t}: {n} row(s)" for t, n in sorted(planned.topics.items())]
        raise HTTPException(404)

    def _execute(self, asked: _Asked, operator: actions.Operator, reason: str) -> int:
        if asked.verb == "requeue":
            return len(
                actions.requeue(
                    self.engine,
                    operator=operator,
                    reason=reason,
                    ids=asked.ids or None,
                    topic=asked.topic,
                )
            )
        if asked.verb == "skip":
            if not asked.ids:
                raise ValueError("name the rows to skip")
            return len(actions.skip(self.engine, operator=operator, ids=asked.ids, reason=reason))
        if asked.verb == "reclaim":
            actions.reclaim(self.engine, asked.task_id(), operator=operator, reason=reason)
            return 1
        if asked.verb == "republish":
            from oncely.relay.publisher import Publisher
            from oncely.relay.service import producer_config

            if self.kafka is None:
                raise ValueError("the console was started without Kafka: it cannot republish")
            relay = self.relay or RelaySettings()
            publisher = Publisher(
                producer_config(self.kafka, relay),
                client=self.kafka.client_config(),
                cloudevents_source=relay.cloudevents_source,
            )
            since, until = asked.window()
            plan = actions.republish_window(
                self.engine,
                operator=operator,
                publisher=publisher,
                since=since,
                until=until,
                event_type=asked.event_type,
                reason=reason,
            )
            return plan.rows
        raise HTTPException(404)

    def _figures(self) -> dict[str, Any]:
        config = self.kafka.client_config() if self.kafka else None
        due = self._completeness.due(self.completeness.interval_seconds)
        status = collect_status(
            self.engine,
            effects=self.effects,
            kafka_config=config,
            timeout=KAFKA_SECONDS,
            completeness=self.completeness,
            check_completeness=due,
        )
        status = self._completeness.kept(status, checked=due)
        count: int | None = None
        if config is not None and status.kafka_error is None:
            try:
                count = throughput.appended(
                    config, [t.topic for t in status.topics], timeout=KAFKA_SECONDS
                )
            except KafkaException:
                count = None
        ages = [t.oldest_unpublished_seconds for t in status.topics]
        return {
            "status": status,
            "relays": _relays(status),
            "attention": [s for s in status.shards if s.unpublished or not s.leased],
            "oldest": max((a for a in ages if a is not None), default=None),
            "rate": self._rate.sample(count),
            "grace": self.completeness.grace_seconds,
            "interval": max(self.completeness.interval_seconds, 1.0),
            "now": datetime.now(UTC),
        }

    def _payload(self, row: rows.EventRow, decoded: dict[str, Any] | None) -> str | None:
        """The payload as shown: ``None`` when hidden, else its decoded JSON (or its stored
        text) capped at ``settings.payload_bytes``."""
        if self.settings.hide_payloads:
            return None
        text = (
            json.dumps(decoded, indent=2, ensure_ascii=False)
            if decoded is not None
            else row.payload.decode("utf-8", "backslashreplace")
        )
        limit = self.settings.payload_bytes
        if len(text) <= limit:
            return text
        return f"{text[:limit]}\n… ({len(text) - limit} more characters not shown)"


@dataclass(frozen=True)
class _Relay:
    """A relay holding shards, as the overview lists it."""

    owner: str
    exactly_once: bool | None
    shards: str
    oldest_progress_seconds: float


def _relays(status: Status) -> list[_Relay]:
    held: dict[str, list[ShardStatus]] = {}
    for shard in status.shards:
        if shard.leased and shard.owner is not None:
            held.setdefault(shard.owner, []).append(shard)
    return [
        _Relay(
            owner,
            shards[0].exactly_once,
            _ranges([s.shard for s in shards]),
            max(s.progress_age_seconds for s in shards),
        )
        for owner, shards in sorted(held.items())
    ]


def _ranges(numbers: list[int]) -> str:
    """``0-3, 7``: sorted numbers as runs."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


#: Rows listed per page, at most.
_LISTED = 200


@dataclass(frozen=True)
class _Asked:
    """An action as a form names it."""

    verb: str
    ids: Sequence[UUID]
    topic: str | None
    task: UUID | None
    since: str | None
    until: str | None
    event_type: str | None

    def task_id(self) -> UUID:
        if self.task is None:
            raise ValueError("name the task to reclaim")
        return self.task

    def window(self) -> tuple[datetime, datetime | None]:
        if self.since is None:
            raise ValueError("give the window's start (since), e.g. 2026-12-08T10:00 or 2h")
        return parse_moment(self.since), (parse_moment(self.until) if self.until else None)


def _templates() -> Jinja2Templates:
    env = Environment(
        loader=PackageLoader("oncely.web", "templates"),
        autoescape=select_autoescape(default=True),
    )
    env.filters["age"] = _age
    env.filters["when"] = lambda moment: moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return Jinja2Templates(env=env)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return str(timedelta(seconds=round(seconds)))


__all__ = ["VERBS", "Console", "Status"]
