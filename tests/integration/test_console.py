"""The console's routes against real PostgreSQL (and Kafka where an event's record is looked
up): every screen, auth refused and accepted, read-only without write routes, a cross-site POST
refused, each action's dry run then execution, and its audit entry."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from fastapi import FastAPI, HTTPException, Request
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.orm import Session

from oncely import stage
from oncely.settings import CompletenessSettings, KafkaSettings, WebSettings
from oncely.storage.stores import audit
from oncely.web import Console, basic_auth
from tests.apps import ledger
from tests.helpers import (
    fast_settings,
    insert_rows,
    oncely_cli,
    outbox_row,
    park,
    query_one,
    read_topics,
    running_consumers,
    running_relay,
    scalar,
    wait_until,
)
from tests.helpers.outbox import acknowledge_all, count_published

pytestmark = pytest.mark.integration

BASE = "http://console.test"
USER, PASSWORD = "ops", "s3cret-pw"


def _auth(user: str = USER, password: str = PASSWORD) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@pytest.fixture
def console_of(engine: sa.Engine) -> Iterator[Callable[..., TestClient]]:
    """``console_of(read_only=False, **console) -> TestClient`` behind Basic auth."""
    clients: list[TestClient] = []

    def make(read_only: bool = False, hide: bool = False, **given: object) -> TestClient:
        settings = WebSettings(
            user=USER, password=SecretStr(PASSWORD), read_only=read_only, hide_payloads=hide
        )
        console = Console(engine=given.pop("engine", engine), settings=settings, **given)  # type: ignore[arg-type]
        client = TestClient(console.app(basic_auth(settings)), base_url=BASE)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _dead_row(engine: sa.Engine) -> dict[str, object]:
    """A row of topic ``orders`` staged and parked dead by the relay."""
    row = outbox_row("orders")
    insert_rows(engine, [row])
    park(engine, row, error="refused")
    return row


def _csrf_of(page: str) -> str:
    """The CSRF token of the form a page rendered."""
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


SCREENS = ["/", "/figures", "/events", "/events?q=acc-1", "/parked", "/tasks", "/audit"]


@pytest.mark.parametrize("path", SCREENS)
def test_every_screen_refuses_without_credentials_and_answers_with_them(
    console_of: Callable[..., TestClient], path: str
) -> None:
    client = console_of()
    refused = client.get(path)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == 'Basic realm="oncely"'
    assert client.get(path, headers=_auth(password="wrong")).status_code == 401
    assert client.get(path, headers=_auth(user="nobody")).status_code == 401
    answered = client.get(path, headers=_auth())
    assert answered.status_code == 200, answered.text
    if path != "/figures":  # a fragment the overview swaps in, without the page around it
        assert "oncely console" in answered.text and USER in answered.text


def test_the_overview_shows_the_backlog_parked_keys_and_tasks(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    rows = [outbox_row("orders", f"k{n}") for n in range(3)]
    insert_rows(engine, rows)
    park(engine, rows[0], error="broker refused it")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_tasks (id, task_key, name, payload, policy, status, "
                "max_attempts) VALUES (:id, 'k', 'email.send', '{}', 'retry_safe', 'dead', 3)"
            ),
            {"id": uuid.uuid4()},
        )
    page = console_of().get("/figures", headers=_auth())
    assert page.status_code == 200
    assert '<b id="backlog">3</b>' in page.text
    assert "<code>orders</code>" in page.text
    assert 'Dead tasks<b class="bad">1</b>' in page.text
    overview = console_of().get("/", headers=_auth())
    assert 'hx-get="http://console.test/figures"' in overview.text, "the figures refresh"
    assert 'hx-trigger="every 5.0s"' in overview.text


def test_read_only_has_no_write_route_and_offers_no_action(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    row = _dead_row(engine)
    client = console_of(read_only=True)
    for path in ("/", "/parked", f"/events/{row['id']}", "/tasks", "/audit"):
        page = client.get(path, headers=_auth())
        assert page.status_code == 200
        assert "/actions/" not in page.text, f"{path} offers an action"
    assert client.get(f"/actions/requeue?id={row['id']}", headers=_auth()).status_code == 404
    posted = client.post(
        "/actions/requeue",
        data={"id": str(row["id"]), "reason": "x"},
        headers={**_auth(), "Origin": BASE},
    )
    assert posted.status_code in (404, 405)
    assert scalar(engine, "SELECT request FROM oncely_relay_parked") is None


def test_a_cross_site_post_or_a_missing_token_is_refused(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    row = _dead_row(engine)
    client = console_of()
    plan = client.get(f"/actions/requeue?id={row['id']}", headers=_auth())
    token = _csrf_of(plan.text)
    form = {"id": str(row["id"]), "reason": "retry", "csrf": token}
    for headers in (
        {"Origin": "http://evil.example"},
        {"Referer": "http://evil.example/page"},
        {},  # neither Origin nor Referer
    ):
        refused = client.post("/actions/requeue", data=form, headers={**_auth(), **headers})
        assert refused.status_code == 403, headers
    wrong = client.post(
        "/actions/requeue", data={**form, "csrf": "0" * 64}, headers={**_auth(), "Origin": BASE}
    )
    assert wrong.status_code == 403 and "CSRF" in wrong.text
    assert scalar(engine, "SELECT request FROM oncely_relay_parked") is None
    assert scalar(engine, "SELECT count(*) FROM oncely_audit") == 0


def _execute(client: TestClient, plan_path: str, verb: str, reason: str) -> str:
    """Open the dry run at ``plan_path``, then submit its form; return the page it ends on."""
    plan = client.get(plan_path, headers=_auth())
    assert plan.status_code == 200, plan.text
    form: dict[str, list[str]] = {}
    for field in plan.text.split('<input type="hidden" ')[1:]:
        name = field.split('name="', 1)[1].split('"', 1)[0]
        value = field.split('value="', 1)[1].split('"', 1)[0]
        form.setdefault(name, []).append(value)
    done = client.post(
        f"/actions/{verb}",
        data={**form, "reason": reason},
        headers={**_auth(), "Origin": BASE},
        follow_redirects=True,
    )
    assert done.status_code == 200, done.text
    return done.text


def test_requeue_and_skip_show_a_dry_run_then_execute_and_are_audited(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    first, second, behind = (
        outbox_row("orders", "a"),
        outbox_row("orders", "b"),
        outbox_row("orders", "a"),
    )
    insert_rows(engine, [first, second, behind])
    park(engine, first, error="too large", held=[behind])
    park(engine, second, "delayed", until_seconds=3600)
    client = console_of()

    plan = client.get(f"/actions/requeue?id={first['id']}", headers=_auth())
    assert "Would requeue 1 row(s). Nothing has changed yet." in plan.text
    assert "1 held" in plan.text
    assert scalar(engine, "SELECT count(*) FROM oncely_relay_parked WHERE request IS NOT NULL") == 0

    page = _execute(client, f"/actions/requeue?id={first['id']}", "requeue", "fixed the size")
    assert "requeue carried out: 1 row(s) changed" in page
    assert (
        scalar(engine, "SELECT request FROM oncely_relay_parked WHERE event_id = :i", i=first["id"])
        == "requeue"
    )
    page = _execute(client, f"/actions/skip?id={second['id']}", "skip", "not needed")
    assert (
        scalar(
            engine, "SELECT request FROM oncely_relay_parked WHERE event_id = :i", i=second["id"]
        )
        == "skip"
    )

    with engine.connect() as conn:
        skipped, requeued = audit.entries(conn)
    assert (requeued.actor, requeued.via, requeued.action, requeued.rows, requeued.reason) == (
        USER,
        "web",
        "requeue",
        1,
        "fixed the size",
    )
    assert str(first["id"]) in requeued.target
    assert (skipped.action, skipped.reason) == ("skip", "not needed")
    assert "fixed the size" in page and "not needed" in page, "the audit page reads them back"


def test_a_dead_task_is_retried_after_its_dry_run(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    task_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_tasks (id, task_key, name, payload, policy, status, attempts,"
                " max_attempts, last_error) VALUES (:id, 'k1', 'email.send', '{}', 'retry_safe',"
                " 'dead', 3, 3, 'SMTP 550')"
            ),
            {"id": task_id},
        )
    client = console_of()
    tasks = client.get("/tasks", headers=_auth())
    assert "SMTP 550" in tasks.text and f"/actions/reclaim?task={task_id}" in tasks.text
    plan = client.get(f"/actions/reclaim?task={task_id}", headers=_auth())
    assert "Would reclaim 1 task" in plan.text
    assert scalar(engine, "SELECT status FROM oncely_tasks") == "dead", (
        "the dry run changes nothing"
    )
    _execute(client, f"/actions/reclaim?task={task_id}", "reclaim", "SMTP fixed")
    assert scalar(engine, "SELECT status FROM oncely_tasks") == "queued"
    entry = query_one(engine, "SELECT action, target, reason FROM oncely_audit")
    assert tuple(entry) == ("reclaim", f"task {task_id}", "SMTP fixed")
    refused = client.get(f"/actions/reclaim?task={task_id}", headers=_auth())
    assert refused.status_code == 409 and "only a stale, dead or failed task" in refused.text


def test_an_execution_needs_a_reason(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    row = _dead_row(engine)
    client = console_of()
    plan = client.get(f"/actions/requeue?id={row['id']}", headers=_auth())
    token = _csrf_of(plan.text)
    empty = client.post(
        "/actions/requeue",
        data={"id": str(row["id"]), "csrf": token, "reason": "  "},
        headers={**_auth(), "Origin": BASE},
    )
    assert empty.status_code == 400 and "give a reason" in empty.text
    assert scalar(engine, "SELECT count(*) FROM oncely_audit") == 0


def test_payloads_are_capped_collapsed_and_hidden_on_request(
    console_of: Callable[..., TestClient], engine: sa.Engine
) -> None:
    row = outbox_row("orders", payload=b'{"secret": "' + b"x" * 10_000 + b'"}')
    insert_rows(engine, [row])
    park(engine, row, error="refused")
    shown = console_of().get(f"/events/{row['id']}", headers=_auth())
    assert "<details><summary>as stored</summary>" in shown.text
    assert "more characters not shown" in shown.text and "x" * 5000 not in shown.text
    parked = console_of().get("/parked", headers=_auth())
    assert "<details><summary>payload</summary>" in parked.text and "secret" in parked.text
    for path in (f"/events/{row['id']}", "/parked"):
        hidden = console_of(hide=True).get(path, headers=_auth())
        assert "secret" not in hidden.text, path


def test_cli_actions_are_audited_and_read_back(engine: sa.Engine, database_url: str) -> None:
    row = _dead_row(engine)
    done = oncely_cli(
        "dead",
        "requeue",
        str(row["id"]),
        "--yes",
        "--reason",
        "ticket 42",
        "--database-url",
        database_url,
    )
    assert done.exit_code == 0, done.output
    listed = oncely_cli("audit", "--json", "--database-url", database_url)
    assert listed.exit_code == 0, listed.output
    assert '"via": "cli"' in listed.output and '"reason": "ticket 42"' in listed.output
    dry = oncely_cli("dead", "skip", str(row["id"]), "--database-url", database_url)
    assert dry.exit_code == 0
    assert scalar(engine, "SELECT count(*) FROM oncely_audit") == 1, "a dry run is not audited"


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("ledger_tables")
def test_an_event_is_followed_from_its_row_to_its_record_and_each_receipt(
    console_of: Callable[..., TestClient],
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_ledger: Callable[..., ledger.App],
) -> None:
    app = new_ledger(1)
    with Session(engine) as session, session.begin():
        good = stage(session, app.model(account_id="acc-1", amount=5, n=1))
        bad = stage(session, app.model(account_id="acc-1", amount=-5, n=2))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == 2, timeout=60)
    with running_consumers(app.effects, ["ledger"], engine, kafka_bootstrap):
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 1, timeout=60)
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_dead_lettered") == 1, timeout=60
        )
    from oncely.schemas.codec import Codec

    client = console_of(
        effects=app.effects,
        codec=Codec(registry=app.registry),
        kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
    )
    page = client.get(f"/events/{good.id}", headers=_auth())
    assert page.status_code == 200
    assert "published" in page.text and "&#34;amount&#34;: 5" in page.text, "decoded"
    assert f"<code>{app.topic}</code> partition 0 offset 0" in page.text
    assert "(from receipt)" in page.text
    failed = client.get(f"/events/{bad.id}", headers=_auth())
    ledger_row = failed.text.split("<code>ledger</code>", 1)[0].rsplit("<tr", 1)[1]
    assert 'class="missing"' in ledger_row, "the failed effect is highlighted"
    assert "1 effect(s) dead-lettered this event: ledger" in failed.text
    assert "handler_failed" in failed.text and f"{app.topic}.ledger.dlq" in failed.text
    assert "(from kafka)" in failed.text, "no receipt places it: found on Kafka"
    letters = client.get("/parked", headers=_auth()).text.split('id="dead-lettered"', 1)[1]
    assert str(bad.id) in letters and "handler_failed" in letters
    assert f"--effect ledger --to-offset {app.topic}:0:1 --execute" in letters
    assert "effect(s) have no receipt of this published event: audit, email" in failed.text
    by_key = client.get("/events?q=acc-1", headers=_auth())
    assert str(good.id) in by_key.text and str(bad.id) in by_key.text
    missing = client.get(f"/events/{uuid.uuid4()}", headers=_auth())
    assert missing.status_code == 404 and "never staged, or retention purged it" in missing.text
    jump = client.get(f"/events?q={good.id}", headers=_auth(), follow_redirects=False)
    assert jump.status_code == 303

    # The overview's completeness: the ledger dead-lettered the bad event (not missing); the
    # effects that never ran miss both.
    checked = console_of(
        effects=app.effects, completeness=CompletenessSettings(grace_seconds=0, bucket_seconds=1)
    ).get("/figures", headers=_auth())
    table = checked.text.split('id="completeness"', 1)[1].split("</table>", 1)[0]
    rows = {row.split("<code>", 1)[1].split("</code>", 1)[0]: row for row in table.split("<tr")[2:]}
    assert '<td class="n">0</td>' in rows["ledger"] and 'class="missing"' not in rows["ledger"]
    assert '<td class="n">2</td>' in rows["audit"] and 'class="missing"' in rows["audit"]
    assert str(good.id)[:13] in rows["audit"], "the oldest missing events link to their pages"

    # Republish the window: its dry run counts the rows, then they go to Kafka again.
    plan = client.get("/actions/republish?since=1h", headers=_auth())
    assert "Would republish 2 row(s)" in plan.text and f"{app.topic}: 2 row(s)" in plan.text
    assert len(read_topics(kafka_bootstrap, [app.topic])) == 2, "the dry run sends nothing"
    _execute(client, "/actions/republish?since=1h", "republish", "rebuild the search index")
    assert len(read_topics(kafka_bootstrap, [app.topic])) == 4
    entry = query_one(engine, "SELECT action, rows, reason FROM oncely_audit")
    assert tuple(entry) == ("republish", 2, "rebuild the search index")


def test_a_service_mounts_the_console_under_its_path_behind_its_own_auth(
    engine: sa.Engine,
) -> None:
    def current_user(request: Request) -> str:  # the service's own auth dependency
        if request.headers.get("x-user") != "alice":
            raise HTTPException(403, detail="not signed in")
        return "alice"

    service = FastAPI()
    service.include_router(Console(engine=engine).router(current_user), prefix="/ops")
    row = _dead_row(engine)
    with TestClient(service, base_url=BASE) as client:
        assert client.get("/ops/").status_code == 403
        page = client.get("/ops/", headers={"x-user": "alice"})
        assert page.status_code == 200
        assert f'href="{BASE}/ops/parked"' in page.text
        assert f'src="{BASE}/ops/static/htmx.min.js"' in page.text
        script = client.get("/ops/static/htmx.min.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith(
            "text/javascript"
        )
        plan = client.get(f"/ops/actions/requeue?id={row['id']}", headers={"x-user": "alice"})
        token = _csrf_of(plan.text)
        done = client.post(
            "/ops/actions/requeue",
            data={"id": str(row["id"]), "csrf": token, "reason": "from the service"},
            headers={"x-user": "alice", "Origin": BASE},
            follow_redirects=False,
        )
        assert done.status_code == 303 and done.headers["location"].startswith(f"{BASE}/ops/audit")
    entry = query_one(engine, "SELECT actor, via, reason FROM oncely_audit")
    assert tuple(entry) == ("alice", "web", "from the service")


def test_the_console_role_reads_every_screen(
    console_of: Callable[..., TestClient], engine: sa.Engine, database_url: str
) -> None:
    from sqlalchemy.engine import make_url

    role = f"console_{uuid.uuid4().hex[:8]}"
    printed = oncely_cli("db", "sql", "--roles", "--console", role)
    assert printed.exit_code == 0, printed.output
    grants = "-- console:" + printed.output.split("-- console:", 1)[1]
    assert "INSERT" not in grants and "UPDATE" not in grants and "DELETE" not in grants
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        conn.exec_driver_sql(grants)
    reader = sa.create_engine(make_url(database_url).set(username=role, password="pw"))
    row = _dead_row(engine)
    acknowledge_all(engine)
    try:
        client = console_of(read_only=True, engine=reader)
        for path in [*SCREENS, f"/events/{row['id']}"]:
            page = client.get(path, headers=_auth())
            assert page.status_code == 200, (path, page.text[-2000:])
    finally:
        reader.dispose()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
