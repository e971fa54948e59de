"""The console in a real browser: Debian's headless Chromium, driven by Playwright, against the
console served over HTTP on real PostgreSQL and Kafka, with a real relay and consumer.

Each test writes a screenshot of the screens it reaches into docs/how-to/img/ (the pictures of
docs/how-to/console.md). `make test` installs Chromium (`make test-tools`); under CI=true a
missing Chromium fails these tests instead of skipping them.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import uvicorn
from playwright.sync_api import Browser, Page, expect, sync_playwright
from pydantic import SecretStr
from sqlalchemy.orm import Session

from oncely import stage
from oncely.schemas.codec import Codec
from oncely.settings import KafkaSettings, WebSettings
from oncely.web import Console, basic_auth
from tests.apps import ledger
from tests.helpers import (
    fast_settings,
    insert_rows,
    outbox_rows,
    running_consumers,
    running_relay,
    scalar,
    set_topic_config,
    wait_until,
)
from tests.helpers.outbox import count_published

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: The flags this machine's closed network needs (without the background-networking ones,
#: Chromium's own connections are refused, many at a time).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "img"
USER, PASSWORD = "ops", "browser-pw"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        message = f"no Chromium at {CHROMIUM}: run `make test-tools` (Debian's chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        # launch() gives Chromium a new, empty --user-data-dir of its own every time.
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """``serve(console) -> base URL``: the console behind Basic auth, over HTTP."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(console: Console) -> str:
        port = _free_port()
        config = uvicorn.Config(
            console.app(basic_auth(console.settings)),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            ws="none",
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_until(lambda: server.started, timeout=10)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def _settings(**given: object) -> WebSettings:
    return WebSettings(user=USER, password=SecretStr(PASSWORD), refresh_seconds=0.5, **given)  # type: ignore[arg-type]


def _page(browser: Browser) -> Page:
    context = browser.new_context(
        http_credentials={"username": USER, "password": PASSWORD},
        viewport={"width": 1280, "height": 860},
    )
    return context.new_page()


def _shoot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"console-{name}.png"), full_page=True)


@pytest.mark.timeout(180)
def test_log_in_and_watch_the_backlog_fall_while_a_relay_runs(
    browser: Browser,
    serve: Callable[..., str],
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=2)
    insert_rows(engine, outbox_rows(3000, topics=[topic], keys=50))
    url = serve(
        Console(
            engine=engine,
            settings=_settings(),
            kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
        )
    )
    anonymous = browser.new_context()
    assert anonymous.request.get(url + "/").status == 401, "no credentials, no console"
    anonymous.close()

    page = _page(browser)
    assert page.goto(url + "/").status == 200
    expect(page.locator("header .who")).to_contain_text(USER)
    expect(page.locator("#backlog")).to_have_text("3000")
    page.evaluate("window.__notReloaded = true")
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        expect(page.locator("#backlog")).not_to_have_text("3000", timeout=60_000)
        expect(page.locator("#backlog")).to_have_text("0", timeout=60_000)
    assert page.evaluate("window.__notReloaded") is True, "the figures refreshed in place"
    assert count_published(engine) == 3000
    page.context.close()


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("ledger_tables")
def test_look_up_an_event_whose_effect_failed_and_see_it_highlighted(
    browser: Browser,
    serve: Callable[..., str],
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_ledger: Callable[..., ledger.App],
) -> None:
    app = new_ledger(1)
    with Session(engine) as session, session.begin():
        stage(session, app.model(account_id="acc-7", amount=12, n=1))
        failed = stage(session, app.model(account_id="acc-7", amount=-3, n=2))
    with running_relay(engine, kafka_bootstrap, fast_settings()):
        wait_until(lambda: count_published(engine) == 2, timeout=60)
    with running_consumers(app.effects, ["ledger", "email"], engine, kafka_bootstrap):
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM oncely_receipts") == 3, timeout=60)
        wait_until(
            lambda: scalar(engine, "SELECT count(*) FROM oncely_dead_lettered") == 1, timeout=60
        )
    url = serve(
        Console(
            engine=engine,
            settings=_settings(),
            effects=app.effects,
            codec=Codec(registry=app.registry),
            kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
        )
    )
    page = _page(browser)
    page.goto(url + "/")
    page.fill("header input[name=q]", str(failed.id))
    page.press("header input[name=q]", "Enter")
    expect(page.locator("h1")).to_contain_text(str(failed.id))
    missing = page.locator("#receipts tr.missing")
    expect(missing.filter(has_text="ledger")).to_have_count(1)
    expect(page.locator("#receipts tr", has_text="email")).not_to_have_class("missing")
    expect(page.locator("#event-tasks")).to_contain_text("email.send")
    expect(page.locator("#failed-note")).to_contain_text("dead-lettered this event: ledger")
    page.locator("details summary").click()
    expect(page.locator("#payload")).to_contain_text('"amount": -3')
    _shoot(page, "event")
    page.click("text=acc-7")
    expect(page.locator("#key-events tr")).to_have_count(3)  # the header and the key's 2 events
    page.context.close()


@pytest.mark.timeout(180)
def test_requeue_a_dead_row_and_see_it_published(
    browser: Browser,
    serve: Callable[..., str],
    engine: sa.Engine,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=1, config={"max.message.bytes": "10000"})
    rows = outbox_rows(6, topics=[topic], keys=2)
    rows[2]["payload"] = os.urandom(50_000)  # key-0's second: refused by the broker
    insert_rows(engine, rows)
    with engine.begin() as conn:  # a dead task too, for the tasks screen
        conn.execute(
            sa.text(
                "INSERT INTO oncely_tasks (id, task_key, name, payload, policy, status, "
                "attempts, max_attempts, last_error) VALUES (:id, 'send-receipt:1', "
                "'email.send', '{}', 'irreversible', 'dead', 3, 3, 'SMTP 554: rejected')"
            ),
            {"id": uuid.uuid4()},
        )
    url = serve(
        Console(
            engine=engine,
            settings=_settings(),
            kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
        )
    )
    page = _page(browser)
    with running_relay(engine, kafka_bootstrap, fast_settings(max_attempts=1)):
        wait_until(lambda: count_published(engine) == 4, timeout=60)
        page.goto(url + "/")
        expect(page.locator("#topics")).to_contain_text(topic)
        _shoot(page, "overview")
        page.goto(url + "/parked")
        dead_row = page.locator("#parked tr", has_text=str(rows[2]["id"]))
        expect(dead_row).to_contain_text("dead")
        _shoot(page, "parked")
        page.goto(url + "/tasks")
        expect(page.locator("#tasks")).to_contain_text("SMTP 554")
        _shoot(page, "tasks")

        set_topic_config(kafka_bootstrap, topic, "max.message.bytes", "200000")
        page.goto(url + "/parked")
        page.locator("#parked tr", has_text=str(rows[2]["id"])).locator("text=requeue").click()
        expect(page.locator("#would")).to_have_text(
            "Would requeue 1 row(s). Nothing has changed yet."
        )
        _shoot(page, "dry-run")
        assert scalar(engine, "SELECT count(*) FROM oncely_audit") == 0
        page.fill("textarea[name=reason]", "topic limit raised, ticket OPS-17")
        page.click("#execute")
        expect(page.locator("#done")).to_contain_text("requeue carried out: 1 row(s) changed")
        expect(page.locator("#audit")).to_contain_text("ticket OPS-17")
        _shoot(page, "audit")
        wait_until(lambda: count_published(engine) == 6, timeout=60)
    page.goto(f"{url}/events/{rows[2]['id']}")
    expect(page.locator("#state")).to_have_text("published")
    page.context.close()


def test_read_only_mode_offers_no_action(
    browser: Browser, serve: Callable[..., str], engine: sa.Engine
) -> None:
    rows = outbox_rows(2, topics=["orders"], keys=1)
    insert_rows(engine, rows)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO oncely_relay_parked (topic, aggregateid, shard, event_id, reason, "
                "error) SELECT topic, aggregateid, shard, id, 'dead', 'refused' FROM oncely_outbox "
                "WHERE id = :id"
            ),
            {"id": rows[0]["id"]},
        )
    url = serve(Console(engine=engine, settings=_settings(read_only=True)))
    page = _page(browser)
    for path in ("/", "/parked", f"/events/{rows[0]['id']}", "/tasks", "/audit"):
        page.goto(url + path)
        expect(page.locator("header .who")).to_contain_text("read-only")
        expect(page.locator("a[href*='/actions/'], form[action*='/actions/']")).to_have_count(0)
        expect(page.locator("button")).to_have_count(0)
    assert page.goto(f"{url}/actions/requeue?id={rows[0]['id']}").status == 404
    page.context.close()
