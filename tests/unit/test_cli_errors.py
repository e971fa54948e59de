"""The command line's error boundary: a user's error is one line on stderr and exit status 2
(bad input or configuration) or 1 (a failed operation), never a traceback."""

from __future__ import annotations

import importlib.metadata
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from tools.gen_reference import cli_env_vars, other_env_vars, renamed_env_vars, settings_env_vars

import oncely
import oncely.cli._kafka
from oncely.cli import app
from oncely.cli._environment import (
    OPTION_VARIABLES,
    OTHER_VARIABLES,
    known_variables,
    option_variables,
)
from oncely.cli._errors import run

#: Nothing listens on port 1: a connection is refused at once.
UNREACHABLE_DATABASE = "postgresql+psycopg://nobody@127.0.0.1:1/nothing"


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    children = getattr(command, "commands", None)
    if not children:
        yield path, command
    for name, child in sorted((children or {}).items()):
        yield from _commands(child, (*path, name))


def _with_database_url() -> list[tuple[str, ...]]:
    return [
        path
        for path, command in _commands(typer.main.get_command(app), ())
        if any(param.name == "database_url" for param in command.params)
    ]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    status = run(app, argv)
    return status, capsys.readouterr().err.splitlines()


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ONCELY_DATABASE_URL", "ONCELY_KAFKA_BOOTSTRAP_SERVERS", "ONCELY_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def test_every_database_command_refuses_a_url_that_is_not_postgresql(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = _with_database_url()
    assert len(commands) > 15
    monkeypatch.setenv("ONCELY_DATABASE_URL", "mysql://user:secret@db/app")
    for path in commands:
        status, lines = _run([*path], capsys)
        assert status == 2, path
        assert len(lines) == 1 and lines[0].startswith("error: "), (path, lines)
        assert "secret" not in lines[0]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://user:secret@db/app", "a mysql URL: oncely supports PostgreSQL; use postgresql"),
        ("not a url", "not a database URL; use postgresql+psycopg://"),
    ],
)
def test_a_bad_url_is_named_with_the_form_to_use(
    url: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, lines = _run(["dead", "list", "--database-url", url], capsys)
    assert status == 2
    assert len(lines) == 1
    assert lines[0].startswith(f"error: Invalid value for --database-url: {says}")
    assert lines[0].endswith("; see oncely dead list --help")


def test_dev_connect_checks_its_url_before_anything_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, lines = _run(
        [
            "dev",
            "connect",
            "--database-url",
            "mysql://user:secret@db/app",
            "--bootstrap-servers",
            "127.0.0.1:1",
        ],
        capsys,
    )
    assert status == 2
    assert lines == [
        "error: Invalid value for --database-url: a mysql URL: oncely supports PostgreSQL; use "
        "postgresql+psycopg://user:password@host:5432/database; see oncely dev connect --help"
    ]


ANY_ID = "0190c3f0-0000-7000-8000-000000000000"
#: Every one-shot command that reaches PostgreSQL, as it can be run on its own.
ONE_SHOT_DATABASE = {
    ("audit",): [],
    ("db", "upgrade"): [],
    ("dead", "list"): [],
    ("dead", "requeue"): ["--all"],
    ("dead", "skip"): [ANY_ID],
    ("debezium", "drop-slot"): [],
    ("debezium", "purge"): ["--older-than", "7d"],
    ("debezium", "slot"): [],
    ("relay", "purge"): ["--older-than", "7d"],
    ("replay",): ["--from-outbox", "--since", "1h"],
    ("status",): [],
    ("tasks", "list"): [],
    ("tasks", "reclaim"): [ANY_ID],
}
#: They reach Kafka first: an unreachable broker is their first error (tested below).
KAFKA_FIRST = {("receipts", "purge"), ("retention", "plan"), ("retention", "run"), ("verify",)}
#: It writes the connector's configuration from the URL, without connecting.
NO_CONNECTION = {("debezium", "config")}
#: They ride out a database outage (their own tests show it), or start services.
LONG_RUNNING = {("consume",), ("relay", "run"), ("tasks", "run"), ("dev", "connect"), ("web",)}


def test_every_database_command_is_checked_for_an_unreachable_database() -> None:
    assert (
        set(_with_database_url())
        == ONE_SHOT_DATABASE.keys() | KAFKA_FIRST | LONG_RUNNING | NO_CONNECTION
    )


@pytest.mark.parametrize("path", sorted(ONE_SHOT_DATABASE))
def test_an_unreachable_database_is_one_line_and_status_1(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*path, *ONE_SHOT_DATABASE[path]]
    status, lines = _run([*argv, "--database-url", UNREACHABLE_DATABASE], capsys)
    assert status == 1, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: database failure: ")
    assert lines[0].endswith(
        "check --database-url (ONCELY_DATABASE_URL) and that PostgreSQL "
        "runs and accepts the connection"
    )


def test_the_console_refuses_to_start_without_auth_unless_on_localhost_with_no_auth(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ONCELY_WEB_USER", raising=False)
    monkeypatch.delenv("ONCELY_WEB_PASSWORD", raising=False)
    web = ["web", "--database-url", UNREACHABLE_DATABASE]
    status, lines = _run(web, capsys)
    assert (status, lines) == (
        2,
        [
            "error: the console needs ONCELY_WEB_USER and ONCELY_WEB_PASSWORD (Basic auth); on "
            "a loopback --host, --no-auth serves it without them"
        ],
    )
    status, lines = _run([*web, "--host", "0.0.0.0", "--no-auth"], capsys)
    assert status == 2
    assert lines == [
        "error: Invalid value for --no-auth: --no-auth serves the console to anyone who reaches "
        "0.0.0.0: bind a loopback address (--host 127.0.0.1) or set ONCELY_WEB_USER and "
        "ONCELY_WEB_PASSWORD; see oncely web --help"
    ]


def test_a_missing_application_module_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, lines = _run(["schemas", "check", "--registry", "no_such_module:registry"], capsys)
    assert status == 2
    assert lines == [
        "error: cannot import module 'no_such_module' of 'no_such_module:registry': "
        "No module named 'no_such_module'"
    ]


def test_a_malformed_setting_names_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONCELY_RELAY_BATCH_SIZE", "many")
    status, lines = _run(
        [
            "relay",
            "run",
            "--database-url",
            UNREACHABLE_DATABASE,
            "--bootstrap-servers",
            "127.0.0.1:1",
        ],
        capsys,
    )
    assert status == 2
    assert len(lines) == 1
    assert lines[0].startswith("error: ONCELY_RELAY_BATCH_SIZE='many': Input should be a valid")


def test_an_unknown_variable_is_warned_about_with_the_closest_known_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONCELY_RELAY_BATCH_SIZ", "10")
    status, lines = _run(["--help"], capsys)
    assert status == 0
    assert lines == [
        "warning: ONCELY_RELAY_BATCH_SIZ is not an oncely setting "
        "(did you mean ONCELY_RELAY_BATCH_SIZE?); it is ignored"
    ]


def test_the_known_variables_are_those_the_reference_documents() -> None:
    documented = set(settings_env_vars()) | set(cli_env_vars()) | set(renamed_env_vars())
    assert known_variables() == documented | other_env_vars(documented).keys()
    assert set(option_variables(typer.main.get_command(app))) == OPTION_VARIABLES
    assert other_env_vars(documented).keys() == OTHER_VARIABLES


def test_oncely_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_DEBUG", "1")
    with pytest.raises(Exception, match="connection"):
        run(app, ["dead", "list", "--database-url", UNREACHABLE_DATABASE])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(app, ["--version"]) == 0
    assert capsys.readouterr().out == f"oncely {oncely.__version__}\n"
    assert oncely.__version__ == importlib.metadata.version("oncely")


#: Nothing listens on port 1: the broker cannot be reached.
UNREACHABLE_BROKER = ["--bootstrap-servers", "127.0.0.1:1"]
UNREACHABLE_DATABASE_URL = ["--database-url", UNREACHABLE_DATABASE]
LEDGER = ["--app", "tests.apps.ledger:effects", "--effect", "ledger"]


# Not `oncely status`: it shows what the database knows and says in its report that Kafka did
# not answer, exit 3 (tests/integration/test_status.py).
@pytest.mark.parametrize(
    "argv",
    [
        ["topics", "ensure", "--registry", "examples.payments.events:registry"],
        ["receipts", "purge", *LEDGER, "--older-than", "30d", *UNREACHABLE_DATABASE_URL],
        ["replay", *LEDGER, "--to-earliest"],
        ["replay", "--from-outbox", "--since", "1h", "--execute", *UNREACHABLE_DATABASE_URL],
        [
            "verify",
            "--since",
            "1h",
            "--app",
            "tests.apps.ledger:effects",
            *UNREACHABLE_DATABASE_URL,
        ],
    ],
)
def test_an_unreachable_broker_is_one_line_and_status_1(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oncely.cli._kafka, "REACH_SECONDS", 1.0)
    status, lines = _run([*argv, *UNREACHABLE_BROKER], capsys)
    assert status == 1, lines
    assert lines == [
        "error: no Kafka broker answered at 127.0.0.1:1 within 1 s (Failed to get metadata: "
        "Local: Broker transport failure); check --bootstrap-servers "
        "(ONCELY_KAFKA_BOOTSTRAP_SERVERS) and that the broker runs"
    ]


@pytest.mark.slow  # waits for the 10 s
def test_an_unreachable_broker_is_reported_within_10_s(
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.monotonic()
    status, lines = _run(
        [
            "topics",
            "ensure",
            "--registry",
            "examples.payments.events:registry",
            *UNREACHABLE_BROKER,
        ],
        capsys,
    )
    assert time.monotonic() - started < 10
    assert status == 1 and len(lines) == 1 and "no Kafka broker answered" in lines[0]


RELAY_RUN = ["relay", "run", *UNREACHABLE_DATABASE_URL, *UNREACHABLE_BROKER]
CONSUME = ["consume", "tests.apps.ledger:effects", "--effect", "ledger"]
CONSUME += [*UNREACHABLE_DATABASE_URL, *UNREACHABLE_BROKER]
ENSURE = ["topics", "ensure", "--registry", "examples.payments.events:registry"]
ENSURE += UNREACHABLE_BROKER
NOT_JSON = "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2"
NO_SUCH_KEY = (
    'error: the Kafka client refused its configuration: No such configuration property: "no.such'
    '.key"; fix or remove the key in ONCELY_KAFKA_EXTRA (raw librdkafka settings), or the '
    "ONCELY_KAFKA_* setting that sets it"
)


@pytest.mark.parametrize(
    ("argv", "environ", "line"),
    [
        pytest.param(
            RELAY_RUN,
            {"ONCELY_KAFKA_EXTRA": "{bad"},
            f"error: ONCELY_KAFKA_EXTRA {NOT_JSON} (char 1)); set it to a JSON object, or unset it",
            id="extra-not-json",
        ),
        pytest.param(
            ENSURE,
            {"ONCELY_TOPICS_OVERRIDES": "{bad"},
            f"error: ONCELY_TOPICS_OVERRIDES {NOT_JSON} (char 1)); set it to a JSON object, or "
            "unset it",
            id="overrides-not-json",
        ),
        pytest.param(
            ENSURE, {"ONCELY_KAFKA_EXTRA": '{"no.such.key": 1}'}, NO_SUCH_KEY, id="extra-key-ensure"
        ),
        pytest.param(
            RELAY_RUN,
            {"ONCELY_KAFKA_EXTRA": '{"no.such.key": 1}'},
            NO_SUCH_KEY,
            id="extra-key-relay",
        ),
        pytest.param(
            RELAY_RUN,
            {"ONCELY_KAFKA_EXTRA": '{"linger.ms": [5]}'},
            "error: ONCELY_KAFKA_EXTRA at 'linger.ms': Input should be a valid string; fix or "
            "unset the variable (the command's --help lists them)",
            id="extra-value-not-scalar",
        ),
        pytest.param(
            CONSUME,
            {"ONCELY_CONSUMER_LANES": "100"},
            "error: ONCELY_CONSUMER_LANES='100': Input should be less than or equal to 64; fix or "
            "unset the variable (the command's --help lists them)",
            id="lanes-variable",
        ),
        pytest.param(
            [*CONSUME, "--lanes", "100"],
            {},
            "error: Invalid value for --lanes: Input should be less than or equal to 64 (given: "
            "100); see oncely consume --help",
            id="lanes-option",
        ),
        pytest.param(
            [*RELAY_RUN, "--metrics-port", "70000"],
            {},
            "error: Invalid value for --metrics-port: Input should be less than or equal to 65535 "
            "(given: 70000); see oncely relay run --help",
            id="port-option-out-of-range",
        ),
        pytest.param(
            RELAY_RUN,
            {"ONCELY_RELAY_METRICS_PORT": "-1"},
            "error: ONCELY_RELAY_METRICS_PORT='-1': Input should be greater than or equal to 0; "
            "fix or unset the variable (the command's --help lists them)",
            id="port-variable-out-of-range",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_status_2(
    argv: list[str],
    environ: dict[str, str],
    line: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    status, lines = _run(argv, capsys)
    assert status == 2, lines
    assert [x for x in lines if "schema catalog" not in x] == [line]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_taken_metrics_port_is_one_line_and_status_2(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tasks", "run", "examples.payments.tasks:tasks", *UNREACHABLE_DATABASE_URL]
    status, lines = _run([*argv, "--metrics-port", str(taken_port)], capsys)
    assert status == 2
    assert lines == [
        f"error: cannot serve /metrics, /healthz and /readyz on port {taken_port} (Address "
        "already in use); choose a free port with --metrics-port, or stop the process that "
        "listens on it"
    ]
    status, lines = _run(
        [*RELAY_RUN, "--log-format", "text", "--metrics-port", str(taken_port)], capsys
    )
    assert status == 2
    assert lines == [  # the port is bound before the broker is tried: no producer line first
        f"error: cannot serve /metrics, /healthz and /readyz on port {taken_port} (Address "
        "already in use); choose a free port with --metrics-port, or stop the process that "
        "listens on it"
    ]


def test_commands_exit_only_with_a_named_exit_code_and_print_no_error_themselves() -> None:
    """Commands raise; the boundary prints the error and picks the status. A command that exits
    after printing a result names an ``ExitCode``, never a bare number."""
    import ast
    from pathlib import Path

    cli = Path(oncely.__file__).parent / "cli"
    found = []
    for path in sorted(cli.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "[red]error" in source:
            found.append(f"{path.name}: prints an error itself")
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "Exit"
                and node.args
                and not (isinstance(node.args[0], ast.Attribute | ast.IfExp))
            ):
                found.append(f"{path.name}:{node.lineno}: typer.Exit({ast.unparse(node.args[0])})")
    assert not found, found


def test_every_exit_code_has_a_meaning_in_the_reference() -> None:
    from oncely.cli._errors import MEANINGS, ExitCode

    assert set(MEANINGS) == set(ExitCode)
