"""The docs' runnable snippets, executed against real Kafka and PostgreSQL.

Convention, in ``docs/**/*.md`` and ``README.md``: an HTML comment on the line right before a
fenced block marks it (unmarked blocks are illustrations and are not run).

- ``<!-- snippet: run -->``
    - before a ``python`` block: executed, in page order, in one namespace per page;
    - before a ``sh`` block: run by ``bash -euo pipefail`` in the page's directory; must exit 0;
    - before a ``sql`` block: executed against the page's database.
- ``<!-- snippet: background -->`` before a one-command ``sh`` block: started in the background
  (a relay, a consumer, a worker). It must still run when the page ends; SIGTERM must then
  stop it with exit status 0.
- ``<!-- snippet: file=PATH -->``: the block is written to ``PATH`` in the page's directory
  (``myapp/events.py``), importable by later snippets and by ``oncely`` commands.

Each page gets a fresh temporary directory (its working directory, first on ``sys.path``) and
a fresh, empty database (``new_database(empty=True)``, so ``oncely db upgrade`` really runs).
Commands and snippets see ``ONCELY_DATABASE_URL`` and ``ONCELY_KAFKA_BOOTSTRAP_SERVERS`` in the
environment; Python snippets also find ``DATABASE_URL`` and ``BOOTSTRAP`` in their namespace.
A page whose snippets run ``oncely schemas register`` also gets a schema registry's URL in
``ONCELY_SCHEMA_REGISTRY_URL`` (the registry starts for the first such page).
Environment changes a snippet makes are undone after the page.

``test_roles_page_grants_are_enough`` runs the GRANTs of ``docs/how-to/roles.md`` and then every
oncely component as the role the page gives it.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from pydantic import BaseModel
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import oncely
from oncely import debezium
from oncely.consumers.receipts import preview_receipts, purge_receipts
from oncely.ops.republish import plan_republish, republish
from oncely.ops.status import collect_status
from oncely.ops.verify import verify_window
from oncely.relay.publisher import Publisher
from oncely.settings import TaskSettings, TopicSettings
from oncely.storage.stores.outbox import dead
from oncely.storage.stores.outbox.relay import RelayStore
from oncely.tasks import TaskStore
from oncely.topics import ensure_topics, planned_topics
from tests.helpers import (
    count_published,
    fast_settings,
    running_consumers,
    running_relay,
    scalar,
    wait_until,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_MARK = re.compile(r"^<!--\s*snippet:\s*(?P<spec>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
_KINDS = {"run", "background"}


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the first code line, 1-based
    lang: str
    kind: str  # run | background | file
    path: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_snippets(page: Path) -> list[Snippet]:
    """The marked blocks of ``page``, in order; a malformed mark is an error."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for index, line in enumerate(lines):
        mark = _MARK.match(line)
        if mark is None:
            continue
        spec = mark.group("spec")
        fence = _FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{page}:{index + 1}: a snippet mark must precede a ``` fence")
        end = next(i for i in range(index + 2, len(lines)) if lines[i].startswith("```"))
        code = "\n".join(lines[index + 2 : end]) + "\n"
        lang = fence.group("lang")
        if spec.startswith("file="):
            kind, path = "file", spec.removeprefix("file=")
        elif spec in _KINDS:
            kind, path = spec, None
        else:
            raise ValueError(f"{page}:{index + 1}: unknown snippet mark {spec!r}")
        if kind == "run" and lang not in {"python", "sh", "sql"}:
            raise ValueError(f"{page}:{index + 1}: cannot run a {lang!r} block")
        if kind == "background" and (lang != "sh" or len(code.strip().splitlines()) != 1):
            raise ValueError(f"{page}:{index + 1}: a background snippet is one sh command")
        found.append(Snippet(page, index + 3, lang, kind, path, code))
    return found


RUNNABLE = [page for page in PAGES if parse_snippets(page)]


def test_the_docs_have_runnable_snippets() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in RUNNABLE}
    assert "docs/quickstart.md" in names
    quickstart = parse_snippets(ROOT / "docs" / "quickstart.md")
    assert sum(s.kind == "background" for s in quickstart) >= 4


def test_the_quickstart_teaches_one_app_loaded_with_app_as_the_readme_does() -> None:
    quickstart = parse_snippets(ROOT / "docs" / "quickstart.md")
    commands = [
        line.split()
        for snippet in quickstart
        if snippet.lang == "sh"
        for line in snippet.code.splitlines()
        if line.startswith("oncely ")
    ]
    loading = [" ".join(c) for c in commands if c[1] not in {"db", "relay"}]  # no app code
    assert [c for c in loading if "--app myapp.app:app" not in c] == []
    assert len(loading) >= 7
    (bundle,) = [s.code for s in quickstart if s.path == "myapp/app.py" and "effects=" in s.code]
    assert "app = oncely.App(registry=registry, effects=effects, tasks=tasks)" in bundle


@dataclass
class _Background:
    snippet: Snippet
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return f"--- {self.snippet.code.strip()} ({self.snippet.where}) ---\n" + text[-4000:]


class _Page:
    """Runs one page's snippets in order; stops its background processes at the end."""

    def __init__(self, page: Path, workdir: Path, database_url: str, bootstrap: str) -> None:
        self.page = page
        self.workdir = workdir
        self.env = {
            **os.environ,
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # pages rewrite modules within a second
        }
        self.env.pop("ONCELY_FAILPOINTS", None)
        self.namespace: dict[str, Any] = {
            "__name__": "__snippets__",
            "DATABASE_URL": database_url,
            "BOOTSTRAP": bootstrap,
        }
        self.background: list[_Background] = []

    def run(self, snippet: Snippet) -> None:
        self._check_background(snippet)
        if snippet.kind == "file":
            target = self.workdir / (snippet.path or "")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(snippet.code, encoding="utf-8")
            importlib.invalidate_caches()
        elif snippet.kind == "background":
            log = self.workdir / f".background-{len(self.background)}.log"
            with log.open("wb") as sink:
                process = subprocess.Popen(
                    ["bash", "-c", f"exec {snippet.code.strip()}"],
                    cwd=self.workdir,
                    env=self.env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.background.append(_Background(snippet, process, log))
        elif snippet.lang == "python":
            source = "\n" * (snippet.line - 1) + snippet.code
            try:
                exec(compile(source, str(snippet.page), "exec"), self.namespace)
            except Exception:
                self._report(f"python snippet at {snippet.where} failed")
                raise
        elif snippet.lang == "sh":
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", snippet.code],
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if result.returncode != 0:
                self._report(f"sh snippet at {snippet.where} exited {result.returncode}")
                pytest.fail(
                    f"sh snippet at {snippet.where} exited {result.returncode}:\n"
                    f"{snippet.code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}",
                    pytrace=False,
                )
        else:  # sql
            engine = sa.create_engine(self.env["ONCELY_DATABASE_URL"])
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql(snippet.code)
            finally:
                engine.dispose()

    def _check_background(self, snippet: Snippet) -> None:
        for item in self.background:
            if item.process.poll() is not None:
                pytest.fail(
                    f"background snippet {item.snippet.where} exited {item.process.returncode} "
                    f"before {snippet.where}:\n{item.tail()}",
                    pytrace=False,
                )

    def _report(self, what: str) -> None:
        if self.background:
            logs = "\n".join(item.tail() for item in self.background)
            print(f"{what}; background processes:\n{logs}", file=sys.stderr)

    def close(self) -> list[str]:
        """Stop the background processes (SIGTERM); return the problems found."""
        problems = []
        for item in self.background:
            if item.process.poll() is not None:
                problems.append(f"exited early ({item.process.returncode}):\n{item.tail()}")
                continue
            item.process.send_signal(signal.SIGTERM)
        for item in self.background:
            try:
                code = item.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(item.process.pid, signal.SIGKILL)
                item.process.wait()
                problems.append(f"did not stop within 60 s of SIGTERM:\n{item.tail()}")
                continue
            if code != 0 and not any(item.tail() in p for p in problems):
                problems.append(f"SIGTERM gave exit status {code}:\n{item.tail()}")
        for value in self.namespace.values():
            if isinstance(value, sa.Engine):
                value.dispose()
        return problems


@pytest.fixture
def page_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The page's working directory, first on sys.path; its modules are forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None) or ""
        paths = list(getattr(module, "__path__", []) or [])
        if origin.startswith(str(tmp_path)) or any(p.startswith(str(tmp_path)) for p in paths):
            del sys.modules[name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_snippets_run(
    page: Path,
    page_environment: Path,
    new_database: Callable[..., str],
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    database_url = new_database(empty=True)
    monkeypatch.setenv("ONCELY_DATABASE_URL", database_url)
    monkeypatch.setenv("ONCELY_KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    for name in list(os.environ):  # a developer's own Kafka security settings stay out
        if name.startswith("ONCELY_KAFKA_") and name != "ONCELY_KAFKA_BOOTSTRAP_SERVERS":
            monkeypatch.delenv(name)
    snippets = parse_snippets(page)
    for name in [n for n in os.environ if n.startswith("ONCELY_SCHEMA_REGISTRY_")]:
        monkeypatch.delenv(name)  # and a developer's own registry
    if any("schemas register" in snippet.code for snippet in snippets):
        registry_url = request.getfixturevalue("schema_registry_url")
        monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_URL", registry_url)
    runner = _Page(page, page_environment, database_url, kafka_bootstrap)
    try:
        for snippet in snippets:
            runner.run(snippet)
    finally:
        problems = runner.close()
    assert not problems, "background snippets misbehaved:\n" + "\n".join(problems)


# -- docs/how-to/roles.md ---------------------------------------------------------------------

ROLES_PAGE = ROOT / "docs" / "how-to" / "roles.md"


def _file_snippet(page: Path, path: str) -> str:
    [snippet] = [s for s in parse_snippets(page) if s.kind == "file" and s.path == path]
    return snippet.code


def _drop_roles(engine: sa.Engine, roles: list[str]) -> None:
    with engine.begin() as conn:
        existing = set(
            conn.execute(
                sa.text("SELECT rolname FROM pg_roles WHERE rolname = ANY(:r)"), {"r": roles}
            ).scalars()
        )
        for role in roles:
            if role in existing:
                conn.exec_driver_sql(f"DROP OWNED BY {role}")
                conn.exec_driver_sql(f"DROP ROLE {role}")


class _Credited(BaseModel):
    account: str
    amount: int


@pytest.mark.timeout(300)
def test_roles_page_grants_are_enough(
    database_url: str, kafka_bootstrap: str, kafka_admin: AdminClient
) -> None:
    grants = _file_snippet(ROLES_PAGE, "roles.sql")
    durable = _file_snippet(ROLES_PAGE, "roles-durable-command.sql")
    roles = re.findall(r"CREATE ROLE (\w+)", grants)
    assert {"oncely_writer", "oncely_relay", "oncely_consumer", "oncely_task_worker"} <= set(roles)
    owner = sa.create_engine(database_url)
    _drop_roles(owner, roles)
    engines: list[sa.Engine] = [owner]

    def as_role(role: str) -> sa.Engine:
        url = make_url(database_url).set(username=role, password="change-me")
        engine = sa.create_engine(url)
        engines.append(engine)
        return engine

    try:
        with owner.begin() as conn:
            conn.exec_driver_sql(grants)
            conn.exec_driver_sql(durable)
            conn.exec_driver_sql("CREATE TABLE credits (event_id uuid PRIMARY KEY, amount int)")
            conn.exec_driver_sql("GRANT INSERT ON credits TO oncely_consumer")
        _exercise_roles(as_role, owner, kafka_bootstrap, kafka_admin, database_url)
    finally:
        for engine in engines:
            engine.dispose()
        _drop_roles(owner, roles)
        owner.dispose()


def _exercise_roles(
    as_role: Callable[[str], sa.Engine],
    owner: sa.Engine,
    bootstrap: str,
    admin: AdminClient,
    database_url: str,
) -> None:
    registry = oncely.Registry(topic_prefix=f"docs-roles-{uuid.uuid4().hex[:8]}.")
    registry.register(_Credited, name="credited", key="account", aggregate="account")
    ensure_topics(admin, planned_topics(registry, TopicSettings(partitions=1)))

    # The writer stages through a Session, a Connection and an AsyncSession, enqueues tasks,
    # claims idempotency keys, and (with the durable-command grant) delivers after commit.
    writer = as_role("oncely_writer")
    with Session(writer) as session, session.begin():
        oncely.stage(session, _Credited(account="a", amount=1))
        oncely.enqueue_task(session, "note", {"n": 1})
    with writer.begin() as conn:
        oncely.stage_many(conn, [_Credited(account="b", amount=2)])
        oncely.enqueue_task(conn, "note", {"n": 2})

    async def stage_async() -> None:
        url = make_url(database_url).set(username="oncely_writer", password="change-me")
        engine = create_async_engine(url)
        try:
            async with AsyncSession(engine) as session, session.begin():
                oncely.stage(session, _Credited(account="c", amount=3))
                oncely.enqueue_task(session, "note", {"n": 3})
        finally:
            await engine.dispose()

    asyncio.run(stage_async())
    keys = oncely.IdempotencyKeys(writer)
    assert keys.claim("api", "k-1").previous is None
    keys.finish("api", "k-1", "accepted", result={"ok": True})
    assert keys.claim("api", "k-1").duplicate
    delivered: list[str] = []
    command = oncely.DurableCommand(engine=writer)
    result = command.execute(
        lambda session: oncely.stage(session, _Credited(account="d", amount=4)),
        tasks=[
            oncely.PostCommitTask(
                name="note", payload={"n": 4}, deliver=lambda task: delivered.append(task.name)
            )
        ],
    )
    assert delivered == ["note"] and result.completed_tasks

    # The relay publishes them all, then purges.
    relay = as_role("oncely_relay")
    with running_relay(relay, bootstrap, fast_settings()):
        wait_until(lambda: count_published(owner) == 4, timeout=60)

    # The consumer inserts receipts, its effect's rows, and tasks.
    effects = oncely.Effects(registry, group_prefix=f"docs-roles-{uuid.uuid4().hex[:8]}.")

    @effects.effect("credit", on=[_Credited])
    def credit(event: Any, ctx: oncely.EffectContext) -> None:
        ctx.session.execute(
            sa.text("INSERT INTO credits (event_id, amount) VALUES (:e, :a)"),
            {"e": ctx.event_id, "a": event.amount},
        )
        ctx.enqueue_task("note", {"credited": str(ctx.event_id)})

    with running_consumers(effects, ["credit"], as_role("oncely_consumer"), bootstrap):
        wait_until(lambda: scalar(owner, "SELECT count(*) FROM oncely_receipts") == 4, timeout=90)
    assert scalar(owner, "SELECT count(*) FROM credits") == 4

    # The task worker leases, runs, settles, sweeps and purges.
    tasks = oncely.Tasks()
    tasks.handler("note")(lambda task: None)
    worker = oncely.TaskWorker(
        engine=as_role("oncely_task_worker"), tasks=tasks, settings=TaskSettings()
    )
    worker.check()
    assert worker.dispatch_pending(limit=50) == 7
    worker.sweep()
    worker.purge()

    # The operator's commands: status, verify, dead letters, republish, purges, tasks.
    operator = as_role("oncely_operator")
    kafka: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap}
    status = collect_status(operator, effects=effects, kafka_config=kafka)
    assert [effect.effect for effect in status.effects] == ["credit"]
    since = datetime.now(UTC) - timedelta(hours=1)
    report = verify_window(
        operator, kafka_config=kafka, effects=[effects.get("credit")], since=since
    )
    assert report.ok, report.problems
    assert plan_republish(operator, since=since, until=None, event_type=None).rows == 4
    republish(
        operator, publisher=Publisher(kafka, client=kafka), since=since, until=None, event_type=None
    )
    with owner.begin() as conn:  # two dead rows, as the relay parks their keys
        conn.exec_driver_sql(
            "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason) "
            "SELECT topic, aggregateid, shard, id, 'dead' FROM oncely_outbox "
            "WHERE aggregateid IN ('a', 'b')"
        )
        conn.exec_driver_sql(
            "UPDATE oncely_tasks SET status = 'dead' WHERE id IN "
            "(SELECT id FROM oncely_tasks LIMIT 1)"
        )
    listed = dead.list_dead(operator)
    assert len(listed) == 2
    # The dry runs read what the commands would change.
    assert len(dead.matching_dead(operator, ids=[listed[0].id])) == 1
    RelayStore(operator, owner="purge").purge_preview(older_than_seconds=3600)
    preview_receipts(operator, effect="credit", older_than=timedelta(0))
    slot = f"roles_{uuid.uuid4().hex[:10]}"
    with owner.begin() as conn:
        conn.execute(
            sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": slot}
        )
    try:
        plan = debezium.purge_plan(operator, older_than_seconds=3600, slot_name=slot)
        assert plan.slot.name == slot
    finally:
        debezium.drop_slot(owner, slot, timeout=10)
    assert len(dead.requeue(operator, ids=[listed[0].id])) == 1
    assert len(dead.skip(operator, ids=[listed[1].id])) == 1
    RelayStore(operator, owner="purge").purge(older_than_seconds=3600)
    purge_receipts(operator, effect="credit", older_than=timedelta(0), retention=timedelta(0))
    store = TaskStore(engine=operator)
    [dead_task] = store.list_tasks(status="dead")
    assert store.reclaimable(dead_task.id).status == "dead"
    store.reclaim(dead_task.id)
