"""Security settings, secret hygiene, hostile identifiers, staging limits and derived GRANTs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from oncely.devstack.kafka import KafkaNodeConfig, KafkaSecurity, KafkaTls
from oncely.errors import ConfigurationError, DevstackError, OncelyError
from oncely.events import InvalidTopicNameError, Registry
from oncely.producer.staging import (
    HeadersTooLargeError,
    KeyTooLongError,
    PayloadTooLargeError,
    StageLimitError,
    check_limits,
)
from oncely.settings import (
    KAFKA_LOGGER,
    PRODUCER_MESSAGE_MAX_BYTES,
    KafkaSettings,
    StageLimits,
    redact_config,
)
from oncely.storage.queries import query_names
from oncely.storage.roles import (
    COMPONENTS,
    component_privileges,
    grant_statements,
    privileges_of,
    validate_role_name,
)
from oncely.storage.tables import build_metadata, validate_schema_name
from tests.helpers import oncely_cli

SRC = Path(__file__).resolve().parents[2] / "src" / "oncely"
SECRET = "s3cr3t-Pa55"

HOSTILE_IDENTIFIERS = [
    "",
    "public; DROP TABLE oncely_outbox",
    'x" OR "1"="1',
    "Upper",
    "1starts_with_digit",
    "a-b",
    "a b",
    "dollar$",
    "new\nline",
    "nul\x00byte",
    "\u0455chema",  # Cyrillic 's'
    "x" * 64,
    "pg_catalog",
]

# -- Kafka security settings ------------------------------------------------------------------


def test_typed_security_fields_map_to_librdkafka_keys() -> None:
    settings = KafkaSettings(
        bootstrap_servers="broker:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="relay",
        sasl_password=SECRET,  # type: ignore[arg-type]
        ssl_ca_location="/etc/ca.pem",
        extra={"ssl.endpoint.identification.algorithm": "https", "message.max.bytes": 2_000_000},
    )
    assert settings.client_config() == {
        "bootstrap.servers": "broker:9093",
        "logger": KAFKA_LOGGER,
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "relay",
        "sasl.password": SECRET,
        "ssl.ca.location": "/etc/ca.pem",
        "ssl.endpoint.identification.algorithm": "https",
        "message.max.bytes": 2_000_000,
    }
    assert KafkaSettings().client_config() == {
        "bootstrap.servers": "127.0.0.1:9092",
        "logger": KAFKA_LOGGER,
    }


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("ONCELY_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("ONCELY_KAFKA_SASL_USERNAME", "relay")
    monkeypatch.setenv("ONCELY_KAFKA_SASL_PASSWORD", SECRET)
    monkeypatch.setenv("ONCELY_KAFKA_EXTRA", '{"ssl.key.password": "k3y-pw", "linger.ms": 5}')
    config = KafkaSettings(bootstrap_servers="b:1").client_config()
    assert config["sasl.password"] == SECRET and config["ssl.key.password"] == "k3y-pw"
    assert config["linger.ms"] == 5


def test_secrets_are_absent_from_repr_str_and_validation_errors() -> None:
    settings = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_username="u",
        sasl_password=SECRET,  # type: ignore[arg-type]
        extra={"ssl.key.password": "k3y-pw", "sasl.oauthbearer.client.secret": "0auth"},
    )
    for text in (repr(settings), str(settings), f"{settings!r}"):
        assert SECRET not in text and "k3y-pw" not in text and "0auth" not in text
    assert redact_config(settings.client_config())["sasl.password"] != SECRET
    # A conflict, a half-given credential, a bad value: the message never echoes a secret.
    bad_inputs: list[dict[str, object]] = [
        {
            "sasl_username": "u",
            "sasl_password": SECRET,
            "security_protocol": "SASL_SSL",
            "extra": {"sasl.password": SECRET},
        },
        {"sasl_password": SECRET, "security_protocol": "SASL_SSL"},
        {"sasl_username": "u", "sasl_password": SECRET},
        {"sasl_mechanism": SECRET},
        {"extra": {"sasl.password": [SECRET]}},
    ]
    for values in bad_inputs:
        with pytest.raises(ValidationError) as info:
            KafkaSettings(**values)  # type: ignore[arg-type]
        assert SECRET not in str(info.value)
    with pytest.raises(ValidationError, match="ONCELY_KAFKA_SASL_PASSWORD sets it too"):
        KafkaSettings(**bad_inputs[0])  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="SECURITY_PROTOCOL to SASL_SSL"):
        KafkaSettings(**bad_inputs[2])  # type: ignore[arg-type]


def test_cli_help_shows_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_KAFKA_SASL_PASSWORD", SECRET)
    monkeypatch.setenv("ONCELY_DATABASE_URL", f"postgresql+psycopg://u:{SECRET}@h/db")
    for command in (["relay", "run"], ["consume"], ["status"], ["topics", "ensure"], ["verify"]):
        result = oncely_cli(*command, "--help")
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output


# -- the devstack's secured broker ------------------------------------------------------------


def test_secured_broker_properties(tmp_path: Path) -> None:
    tls = KafkaTls(keystore=tmp_path / "broker.p12", keystore_password="ks-pw")
    security = KafkaSecurity(scram_users={"alice": "pw-a", "bob": "pw-b"}, tls=tls)
    config = KafkaNodeConfig(
        data_dir=tmp_path,
        port=1,
        controller_port=2,
        security=security,
        sasl_port=3,
        sasl_ssl_port=4,
    )
    text = config.server_properties()
    assert (
        "listeners=PLAINTEXT://127.0.0.1:1,SASL_PLAINTEXT://127.0.0.1:3,"
        "SASL_SSL://127.0.0.1:4,CONTROLLER://127.0.0.1:2"
    ) in text
    assert "inter.broker.listener.name=PLAINTEXT" in text
    assert "sasl.enabled.mechanisms=SCRAM-SHA-512" in text
    assert "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=" in text
    assert f"ssl.keystore.location={tmp_path / 'broker.p12'}" in text
    assert security.format_arguments() == [
        "--add-scram",
        "SCRAM-SHA-512=[name=alice,password=pw-a]",
        "--add-scram",
        "SCRAM-SHA-512=[name=bob,password=pw-b]",
    ]
    assert "pw-a" not in repr(security) and "ks-pw" not in repr(config)
    plain = KafkaNodeConfig(data_dir=tmp_path, port=1, controller_port=2).server_properties()
    assert "SASL" not in plain and "advertised.listeners=PLAINTEXT://127.0.0.1:1\n" in plain
    with pytest.raises(DevstackError, match="SCRAM user"):
        KafkaSecurity(scram_users={"x": "a,password=b]"})


# -- hostile identifiers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_IDENTIFIERS)
def test_hostile_schema_and_role_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema name"):
        validate_schema_name(name)
    with pytest.raises(ConfigurationError, match="schema name"):
        build_metadata(schema=name)
    if not name.startswith("pg_"):
        with pytest.raises(ConfigurationError, match="role name"):
            validate_role_name(name)
        with pytest.raises(ConfigurationError):
            grant_statements({"relay": name})
    with pytest.raises(ConfigurationError):
        grant_statements({"relay": "oncely_relay"}, schema=name)


@pytest.mark.parametrize(
    "prefix", ["a b.", "x/../", "ev;", "p\n", "ü.", "*", "x" * 249, "topic\x00."]
)
def test_hostile_topic_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(InvalidTopicNameError, match="topic prefix"):
        Registry(topic_prefix=prefix)


def test_cli_refuses_hostile_names_with_exit_2() -> None:
    for args in (
        ["db", "sql", "--roles", "--writer", "w; DROP ROLE postgres"],
        ["db", "sql", "--roles", "--schema", 'x"; --'],
        ["db", "upgrade", "--database-url", "postgresql+psycopg://u@h/d", "--schema", "a;b"],
    ):
        result = oncely_cli(*args)
        assert result.exit_code == 2, result.output
        assert "not a plain identifier" in result.output


# -- staging limits -------------------------------------------------------------------------------


def _row(
    payload: int = 10, key: str = "k", headers: dict[str, str] | None = None
) -> dict[str, object]:
    return {"type": "t.x", "payload": b"p" * payload, "aggregateid": key, "headers": headers or {}}


def test_stage_limits_default_fit_under_the_producer_limit() -> None:
    limits = StageLimits()
    worst = limits.max_payload_bytes + limits.max_key_bytes + limits.max_headers_bytes
    assert worst + 2_000 < PRODUCER_MESSAGE_MAX_BYTES < 1_048_588  # framing and id/eventType


@pytest.mark.parametrize(
    ("row", "error", "setting"),
    [
        (_row(payload=960_001), PayloadTooLargeError, "ONCELY_STAGE_MAX_PAYLOAD_BYTES"),
        (_row(key="ключ" * 200), KeyTooLongError, "ONCELY_STAGE_MAX_KEY_BYTES"),
        (_row(headers={f"h{i}": "v" for i in range(33)}), HeadersTooLargeError, "MAX_HEADERS"),
        (_row(headers={"h": "v" * 16_384}), HeadersTooLargeError, "MAX_HEADERS_BYTES"),
    ],
)
def test_stage_limits_name_the_setting(
    row: dict[str, object], error: type[StageLimitError], setting: str
) -> None:
    with pytest.raises(error, match=setting) as info:
        check_limits(row, StageLimits())
    assert isinstance(info.value, OncelyError) and "t.x" in str(info.value)
    check_limits(_row(payload=960_000, key="k" * 1024), StageLimits())


def test_stage_limits_are_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCELY_STAGE_MAX_PAYLOAD_BYTES", "100")
    with pytest.raises(PayloadTooLargeError):
        check_limits(_row(payload=101), StageLimits())
    check_limits(_row(payload=101), StageLimits(max_payload_bytes=101))


# -- least-privilege GRANTs --------------------------------------------------------------------


def test_privileges_follow_postgresql_rules() -> None:
    assert privileges_of("INSERT INTO oncely_receipts (a) VALUES (1) RETURNING event_id") == {
        "oncely_receipts": {"INSERT", "SELECT:event_id"}
    }
    upsert = "INSERT INTO oncely_receipts (a) VALUES (1) ON CONFLICT ON CONSTRAINT "
    assert privileges_of(upsert + "oncely_receipts_pkey DO NOTHING") == {
        "oncely_receipts": {"INSERT", "SELECT:event_id", "SELECT:effect"}
    }
    claim = privileges_of(
        "WITH due AS (SELECT id FROM oncely_outbox FOR UPDATE SKIP LOCKED) "
        "UPDATE oncely_outbox AS o SET x = 1 FROM due RETURNING o.id"
    )
    assert claim == {"oncely_outbox": {"SELECT", "UPDATE"}}
    assert privileges_of("DELETE FROM oncely_tasks AS t USING doomed") == {
        "oncely_tasks": {"SELECT", "DELETE"}
    }


def _statements_named_in(paths: list[Path], *, only: set[str] | None = None) -> set[str]:
    """The named statements the modules at ``paths`` mention; with ``only``, in those of their
    top-level functions and classes."""
    names = query_names()
    found: set[str] = set()
    for path in paths:
        for top in ast.parse(path.read_text()).body:
            if only is not None and getattr(top, "name", None) not in only:
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.add(node.value)
    return found


#: The modules that run named statements: each table's store (and Debezium's slot queries).
STORES = [
    "storage/stores/outbox/relay.py",
    "storage/stores/outbox/writes.py",
    "storage/stores/outbox/dead.py",
    "storage/stores/outbox/reports.py",
    "storage/stores/outbox/debezium.py",
    "storage/stores/outbox/kept.py",
    "storage/stores/outbox/lookup.py",
    "storage/stores/receipts.py",
    "storage/stores/audit.py",
    "storage/stores/dead_lettered.py",
    "storage/stores/marks.py",
    "tasks/store.py",
    "producer/idempotency.py",
    "debezium/slots.py",
]


def test_only_the_stores_run_named_statements() -> None:
    running = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        # these two load and list the statements; they run none
        if path.relative_to(SRC).as_posix() not in ("storage/queries.py", "storage/roles.py")
        and _statements_named_in([path])
    }
    assert running == set(STORES)


def test_each_component_lists_exactly_the_statements_its_code_runs() -> None:
    assert set(COMPONENTS["relay"].statements) == _statements_named_in(
        [SRC / "storage/stores/outbox/relay.py"]
    )
    assert set(COMPONENTS["writer"].statements) == _statements_named_in(
        [SRC / "producer/idempotency.py", SRC / "storage/stores/outbox/writes.py"]
    )
    receipts = SRC / "storage/stores/receipts.py"
    inserts = _statements_named_in([receipts], only={"insert_receipts", "insert_receipt"})
    # oncely.testing's pipeline waits on receipts: no deployed component runs it.
    harness = _statements_named_in([receipts], only={"applied_pairs"})
    assert harness
    # The consumer process checks its effects' completeness; so does `oncely status`.
    completeness = _statements_named_in(
        [receipts], only={"completeness_bounds", "bucket_counts", "missing_events"}
    )
    consumer = (
        inserts
        | completeness
        | _statements_named_in([SRC / "storage/stores/dead_lettered.py"], only={"record"})
    )
    assert set(COMPONENTS["consumer"].statements) == consumer
    operator_only = {"task_reclaim", "task_get", "task_list", "ops_tasks_by_status", "lookup_tasks"}
    assert set(COMPONENTS["task_worker"].statements) == (
        _statements_named_in([SRC / "tasks/store.py"]) - operator_only
    )
    operator_modules = [
        "storage/stores/outbox/dead.py",
        "storage/stores/outbox/reports.py",
        "storage/stores/outbox/debezium.py",
        "storage/stores/outbox/lookup.py",
        "storage/stores/audit.py",
        "debezium/slots.py",
    ]
    assert set(COMPONENTS["operator"].statements) == (
        _statements_named_in([SRC / m for m in operator_modules])
        | (_statements_named_in([receipts]) - inserts - harness)
        | operator_only
        # `oncely status` and `oncely relay purge` through the relay's store
        | {"relay_backlog", "relay_shards", "relay_purge", "relay_purge_preview"}
        # the console's event lookup through the dead letters' store
        | {"lookup_dead_lettered", "dead_lettered_recent"}
    )
    # The read-only console: what the operator reads, nothing it writes.
    console = set(COMPONENTS["console"].statements)
    assert console < set(COMPONENTS["operator"].statements)
    granted = component_privileges(COMPONENTS["console"]).values()
    assert {p.split(":")[0] for privileges in granted for p in privileges} == {"SELECT"}


def test_roles_match_the_documented_least_privilege() -> None:
    text = grant_statements({"writer": "w", "relay": "r", "consumer": "c", "task_worker": "t"})
    grants = {line for line in text.splitlines() if line.startswith("GRANT")}
    # The relay never updates an outbox row: it reads them, and purges them after retention.
    assert "GRANT SELECT, DELETE ON public.oncely_outbox TO r;" in grants
    assert "GRANT SELECT, UPDATE ON public.oncely_relay_shards TO r;" in grants
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON public.oncely_relay_members TO r;" in grants
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON public.oncely_relay_parked TO r;" in grants
    assert "GRANT SELECT, INSERT, DELETE ON public.oncely_relay_held TO r;" in grants
    assert not any(
        "oncely_receipts" in g or "oncely_tasks" in g for g in grants if g.endswith(" r;")
    )
    assert "GRANT INSERT ON public.oncely_outbox TO w;" in grants
    # The outbox's wake trigger runs as the writer: it reads whether a relay sleeps.
    assert "GRANT SELECT (asleep) ON public.oncely_relay_members TO w;" in grants
    assert not any(
        "oncely_relay_" in g and g.endswith(" w;") and "(asleep)" not in g for g in grants
    )
    assert not any("UPDATE" in g and "oncely_outbox" in g and g.endswith(" w;") for g in grants)
    assert "GRANT SELECT, INSERT, UPDATE ON public.oncely_idempotency_keys TO w;" in grants
    # The partitioned outbox's seq is filled by nextval of a plain sequence (the identity's own
    # sequence has that name when unpartitioned); its key guard runs as the tables' owner.
    assert "GRANT USAGE ON SEQUENCE public.oncely_outbox_seq_seq TO w;" in grants
    assert not any("oncely_outbox_keys" in g for g in grants)
    assert "GRANT SELECT, INSERT ON public.oncely_receipts TO c;" in grants
    # The consumer reads the outbox (never writes it) only to check its effects' completeness,
    # and only the columns that needs: never a payload nor headers.
    consumer_outbox = [g for g in grants if g.endswith(" c;") and "oncely_outbox " in g]
    assert consumer_outbox == [
        "GRANT SELECT (created_at, id, seq, shard, txid, type) ON public.oncely_outbox TO c;"
    ]
    assert "GRANT SELECT, UPDATE, DELETE ON public.oncely_tasks TO t;" in grants
    operator = grant_statements({"operator": "o"})
    # Operators read everything they report on; they write only requests on parked keys,
    # purges and task reclaims: never an outbox row, a shard's progress or a lease.
    assert "GRANT SELECT, UPDATE ON public.oncely_relay_parked TO o;" in operator
    assert "GRANT SELECT ON public.oncely_relay_shards TO o;" in operator
    assert "GRANT SELECT ON public.oncely_relay_held TO o;" in operator
    assert "GRANT SELECT, DELETE ON public.oncely_outbox TO o;" in operator
