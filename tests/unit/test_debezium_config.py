"""The Debezium connector configuration (``oncely debezium config``): pure, checked without Connect.

The records it produces are compared with the relay's in
``tests/integration/test_debezium_parity.py`` against real Kafka Connect.
"""

from __future__ import annotations

import json

import javaproperties
import pytest

from oncely.debezium import ConnectorOptions, connector_config, render, to_properties
from oncely.errors import ConfigurationError
from tests.helpers import oncely_cli

URL = "postgresql+psycopg://app:s3cret@db.internal:6432/shop?sslmode=require"


def test_the_router_reproduces_the_relays_record_contract() -> None:
    config = connector_config(ConnectorOptions.from_database_url(URL))
    router = {k.removeprefix("transforms.outbox."): v for k, v in config.items()}
    assert config["transforms"] == "outbox"
    assert router["type"] == "io.debezium.transforms.outbox.EventRouter"
    assert router["route.by.field"] == "topic"
    assert router["route.topic.replacement"] == "${routedByValue}"
    assert router["table.field.event.id"] == "id"
    assert router["table.field.event.key"] == "aggregateid"
    assert router["table.field.event.payload"] == "payload"
    assert router["table.fields.additional.placement"] == "type:header:eventType"
    assert config["key.converter"] == "org.apache.kafka.connect.storage.StringConverter"
    assert config["value.converter"] == "org.apache.kafka.connect.converters.ByteArrayConverter"
    assert config["extended.headers.enabled"] == "false"
    # Settles, requeues and purges publish nothing.
    assert config["skipped.operations"] == "u,d,t"
    assert config["tombstones.on.delete"] == "false"
    # No partitioner override: Connect's producer hashes the key with murmur2, as the relay.
    assert not any("partitioner" in key for key in config)


def test_the_database_and_replication_settings_come_from_the_url_and_options() -> None:
    options = ConnectorOptions.from_database_url(
        URL, schema="events", slot_name="shop_outbox", publication_name="shop_pub"
    )
    config = connector_config(options)
    assert config["database.hostname"] == "db.internal"
    assert config["database.port"] == "6432"
    assert config["database.user"] == "app"
    assert config["database.password"] == "s3cret"
    assert config["database.dbname"] == "shop"
    assert config["database.sslmode"] == "require"
    assert config["plugin.name"] == "pgoutput"
    assert config["slot.name"] == "shop_outbox"
    assert config["publication.name"] == "shop_pub"
    assert config["publication.autocreate.mode"] == "filtered"
    assert config["table.include.list"] == "events.oncely_outbox"
    # The first snapshot publishes only the unpublished rows, in per-key (seq) order.
    assert config["snapshot.select.statement.overrides"] == "events.oncely_outbox"
    statement = config["snapshot.select.statement.overrides.events.oncely_outbox"]
    assert statement.startswith("SELECT * FROM events.oncely_outbox AS o WHERE ")
    for table in ("oncely_relay_shards", "oncely_relay_held", "oncely_relay_parked"):
        assert f"events.{table} " in statement
    # ... and the rows retention kept aside, as outbox rows.
    assert "NULL::events.oncely_outbox, to_jsonb(k)" in statement
    assert "FROM events.oncely_relay_kept AS k " in statement
    assert statement.endswith("ORDER BY seq")


def test_a_url_without_password_writes_none() -> None:
    config = connector_config(ConnectorOptions.from_database_url("postgresql://u@h/d"))
    assert "database.password" not in config
    assert "database.sslmode" not in config
    assert config["database.port"] == "5432"


def test_a_topic_prefix_and_regex_route_into_another_topic_set() -> None:
    options = ConnectorOptions.from_database_url(
        URL, topic_prefix="B.", route_regex=r"\QA.\E(?<routedByValue>.*)"
    )
    config = connector_config(options)
    assert config["transforms.outbox.route.topic.regex"] == r"\QA.\E(?<routedByValue>.*)"
    assert config["transforms.outbox.route.topic.replacement"] == "B.${routedByValue}"


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("postgresql:///db", {}, "needs a host"),
        (URL, {"slot_name": "Bad-Slot"}, "slot name 'Bad-Slot'"),
        (URL, {"publication_name": "x" * 64}, "publication name"),
        (URL, {"schema": "1public"}, "schema name"),
        (URL, {"route_regex": "A\\.(.*)"}, "routedByValue"),
        (URL, {"topic_prefix": "b/"}, "topic prefix"),
        ("not a url", {}, "database URL is not valid"),
    ],
)
def test_invalid_options_are_refused_with_the_reason(
    url: str, options: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ConnectorOptions.from_database_url(url, **options)


def test_properties_escape_what_java_would_misread() -> None:
    config = {"a b=c": " x=y:z \\Q.\\E é\t", "#k": "#v"}
    text = to_properties(config)
    assert text.startswith("a\\ b\\=c=\\ x")  # separators and a leading space escaped
    assert "\\\\Q.\\\\E \\u00e9\\t" in text  # backslashes, non-ASCII, control characters
    assert text.isascii() and text.endswith("\n\\#k=\\#v\n")  # not a comment line
    assert javaproperties.loads(text) == config


def test_the_properties_file_names_the_connector_first() -> None:
    text = render(ConnectorOptions.from_database_url(URL, name="outbox-1"), "properties")
    assert text.splitlines()[0] == "name=outbox-1"
    assert "transforms.outbox.route.topic.replacement=${routedByValue}\n" in text


def test_cli_prints_the_rest_api_body() -> None:
    result = oncely_cli("debezium", "config", "--database-url", URL, "--slot-name", "s1")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["name"] == "oncely-outbox"
    assert body["config"]["slot.name"] == "s1"


def test_cli_properties_and_errors() -> None:
    config = ("debezium", "config", "--database-url", URL)
    properties = oncely_cli(*config, "--format", "properties")
    assert properties.exit_code == 0
    assert properties.stdout.startswith("name=oncely-outbox\n")
    bad_format = oncely_cli(*config, "--format", "yaml")
    assert bad_format.exit_code == 2
    assert "use json or properties" in bad_format.stderr
    bad_slot = oncely_cli(*config, "--slot-name", "A")
    assert bad_slot.exit_code == 2
    assert "slot name 'A'" in bad_slot.stderr
