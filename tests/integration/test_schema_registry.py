"""avro-confluent events against a real Confluent-compatible schema registry (Apicurio Registry,
or ``ONCELY_TEST_SCHEMA_REGISTRY_URL``), real Kafka and real PostgreSQL.

The catalog is registered as a deploy step (:func:`register_catalog`), ``stage()`` never calls
the registry (the codec's ``warm()`` looks the ids up at start-up; a cold codec refuses), the
relay publishes the framed values and consumers decode them by schema id. ``order.placed`` v2
adds a field with a default to v1 (``tests/apps/orders.py``).
"""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.schema_registry import SchemaRegistryClient
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from pydantic import BaseModel
from sqlalchemy.orm import Session

from oncely.devstack.registry import RegistryTls, SchemaRegistryNode
from oncely.events import Registry
from oncely.producer.staging import stage
from oncely.schemas.catalog import SchemaCatalog, export_schemas
from oncely.schemas.codec import Codec
from oncely.schemas.confluent import schema_id, subject_of
from oncely.schemas.errors import SchemaIdNotLoadedError, SchemaNotRegisteredError
from oncely.schemas.loader import codec_for, schema_registry_client
from oncely.schemas.registration import (
    IncompatibleVersionError,
    RegistrationResult,
    RegistryUnavailableError,
    RegistryVerdict,
    check_registry,
    register_catalog,
)
from oncely.settings import SchemaSettings
from tests.apps.orders import OrderPlacedV2, Version, build, create_tables
from tests.chaos.proxy import FaultyProxy
from tests.helpers import publish_all, read_topics, running_consumers, scalar, wait_until
from tests.integration.secure_kafka import signed_leaf, throwaway_ca

pytestmark = pytest.mark.integration


@dataclass
class Orders:
    """order.placed v1 and v2 (avro-confluent) on a topic of this test, and their catalog."""

    v1: Version
    v2: Version
    catalog_dir: Path

    @property
    def subject(self) -> str:
        return subject_of(self.v2.registry.get("order.placed"))

    def catalog(self) -> SchemaCatalog:
        return SchemaCatalog.load(self.catalog_dir)


@pytest.fixture
def orders(kafka_admin: AdminClient, tmp_path: Path) -> Iterator[Orders]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    v1, v2 = build(prefix, group_prefix=prefix, encoding="avro-confluent")
    kafka_admin.create_topics([NewTopic(v1.topic, num_partitions=2)])[v1.topic].result(30)
    for version in (v1, v2):
        export_schemas(version.registry, tmp_path / "schemas")
    yield Orders(v1, v2, tmp_path / "schemas")
    for future in kafka_admin.delete_topics([v1.topic]).values():
        future.result(30)


@pytest.fixture
def settings(schema_registry_url: str) -> SchemaSettings:
    return SchemaSettings(schema_registry_url=schema_registry_url)


@pytest.fixture
def client(settings: SchemaSettings) -> SchemaRegistryClient:
    return schema_registry_client(settings)


def _stage(engine: sa.Engine, codec: Codec, events: list[BaseModel]) -> None:
    with Session(engine) as session, session.begin():
        for event in events:
            stage(session, event, codec=codec)


def _registered_schema(client: SchemaRegistryClient, subject: str, version: int) -> Any:
    """The schema of ``version`` of ``subject``, parsed (registries may reformat the text)."""
    text = client.get_version(subject, version).schema.schema_str
    assert text is not None
    return json.loads(text)


def _outbox_rows(engine: sa.Engine) -> int:
    count = scalar(engine, "SELECT count(*) FROM oncely_outbox")
    assert isinstance(count, int)
    return count


def test_staged_events_are_relayed_and_consumed_by_their_schema_ids(
    orders: Orders,
    engine: sa.Engine,
    kafka_bootstrap: str,
    schema_registry_url: str,
    client: SchemaRegistryClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    create_tables(engine)
    ids = {
        r.version: r.schema_id
        for r in register_catalog(client, orders.v2.registry, orders.catalog())
    }
    assert set(ids) == {1, 2} and ids[1] != ids[2]

    # A producer still at v1 and one already at v2, both warmed at start-up.
    old = codec_for(orders.v1.registry, SchemaSettings(schema_registry_url=schema_registry_url))
    new = codec_for(
        orders.v2.registry,
        SchemaSettings(schema_registry_url=schema_registry_url, schemas_dir=orders.catalog_dir),
    )
    assert old.warm() == {"order.placed": ids[1]}
    assert new.warm() == {"order.placed": ids[2]}
    _stage(engine, old, [orders.v1.model(order_id=f"o-{i % 3}", amount=i) for i in range(5)])
    _stage(
        engine,
        new,
        [orders.v2.model(order_id=f"o-{i % 3}", amount=i, currency="USD") for i in range(5, 10)],
    )

    publish_all(engine, kafka_bootstrap, 10)
    records = read_topics(kafka_bootstrap, [orders.v1.topic])
    assert len(records) == 10
    framing = {(int(r.headers["schema-version"]), schema_id(r.value)) for r in records}
    assert framing == {(1, ids[1]), (2, ids[2])}, "each value carries its writer's schema id"

    # The v2 consumer fetches each writer schema by id from the registry (ONCELY_*).
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_URL", schema_registry_url)
    monkeypatch.setenv("ONCELY_SCHEMAS_DIR", str(orders.catalog_dir))
    with running_consumers(orders.v2.effects, ["orders"], engine, kafka_bootstrap):
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM orders_applied") == 10, timeout=60)
    with engine.connect() as conn:
        applied = conn.execute(
            sa.text("SELECT amount, currency, code_version FROM orders_applied ORDER BY amount")
        ).all()
    assert [tuple(row) for row in applied] == [
        *[(i, "EUR", 2) for i in range(5)],  # v1 records: the new field takes its default
        *[(i, "USD", 2) for i in range(5, 10)],
    ]


def test_stage_never_registers_by_default_and_warm_says_to_run_register(
    orders: Orders, engine: sa.Engine, client: SchemaRegistryClient
) -> None:
    codec = Codec(registry=orders.v2.registry, schema_registry=client)
    with pytest.raises(SchemaIdNotLoadedError) as not_loaded:
        _stage(engine, codec, [orders.v2.model(order_id="o-1", amount=1)])
    assert "codec.warm()" in str(not_loaded.value) and "\n" not in str(not_loaded.value)
    assert orders.subject not in client.get_subjects(), "stage() registered the schema"
    assert _outbox_rows(engine) == 0, "the transaction rolled back"
    with pytest.raises(SchemaNotRegisteredError) as caught:
        codec.warm()
    message = str(caught.value)
    assert "\n" not in message
    assert "'order.placed' v2" in message and repr(orders.subject) in message
    assert "oncely schemas register" in message


def test_auto_register_registers_on_first_use(
    orders: Orders, engine: sa.Engine, schema_registry_url: str, client: SchemaRegistryClient
) -> None:
    settings = SchemaSettings(
        schema_registry_url=schema_registry_url, schema_registry_auto_register=True
    )
    codec = codec_for(orders.v2.registry, settings)
    _stage(engine, codec, [orders.v2.model(order_id="o-1", amount=1)])
    assert client.get_versions(orders.subject) == [1]
    registered = client.get_version(orders.subject, 1)
    assert (
        _registered_schema(client, orders.subject, 1)
        == orders.v2.registry.get("order.placed").schema
    )
    assert codec.warm() == {"order.placed": registered.schema_id}
    assert _outbox_rows(engine) == 1


def _settled(proxy: FaultyProxy) -> int:
    """The proxy's forwarded bytes once they stop changing (it counts on its own thread)."""
    seen = -1
    while proxy.stats.forwarded_bytes != seen:
        seen = proxy.stats.forwarded_bytes
        time.sleep(0.3)
    return seen


def test_a_warmed_codec_stages_without_calling_the_registry(
    orders: Orders, engine: sa.Engine, client: SchemaRegistryClient, schema_registry_url: str
) -> None:
    list(register_catalog(client, orders.v2.registry, orders.catalog()))
    upstream = schema_registry_url.split("/")[2]
    path = "/" + schema_registry_url.split("/", 3)[3]
    proxy = FaultyProxy()
    proxy.start(upstream=upstream)
    try:
        through_proxy = SchemaSettings(schema_registry_url=f"http://{proxy.address}{path}")
        warmed = codec_for(orders.v2.registry, through_proxy)
        warmed.warm()
        before = _settled(proxy)
        assert before > 0, "warm() looked the id up through the proxy"
        for i in range(5):
            _stage(engine, warmed, [orders.v2.model(order_id=f"o-{i}", amount=i)])
        assert _settled(proxy) == before, "stage() called the registry"

        cold = codec_for(orders.v2.registry, through_proxy)  # not warmed: refused, no call
        with pytest.raises(SchemaIdNotLoadedError):
            _stage(engine, cold, [orders.v2.model(order_id="o-9", amount=9)])
        assert _settled(proxy) == before, "a cold codec's stage() called the registry"
    finally:
        proxy.close()
    assert _outbox_rows(engine) == 5


def test_register_is_idempotent_in_version_order(
    orders: Orders, client: SchemaRegistryClient
) -> None:
    dry = list(register_catalog(client, orders.v2.registry, orders.catalog(), dry_run=True))
    assert [(r.version, r.outcome, r.schema_id) for r in dry] == [
        (1, RegistrationResult.MISSING, None),
        (2, RegistrationResult.MISSING, None),
    ]
    assert orders.subject not in client.get_subjects(), "a dry run registered"

    first = list(register_catalog(client, orders.v2.registry, orders.catalog()))
    assert [(r.version, r.outcome) for r in first] == [
        (1, RegistrationResult.REGISTERED),
        (2, RegistrationResult.REGISTERED),
    ]
    assert {r.subject for r in first} == {orders.subject}
    assert client.get_versions(orders.subject) == [1, 2]
    v1_schema = orders.catalog().versions("order.placed")[0].schema
    assert _registered_schema(client, orders.subject, 1) == v1_schema, "v1 first"

    again = list(register_catalog(client, orders.v2.registry, orders.catalog()))
    assert [(r.version, r.outcome, r.schema_id) for r in again] == [
        (r.version, RegistrationResult.EXISTS, r.schema_id) for r in first
    ]
    assert client.get_versions(orders.subject) == [1, 2]


class _V3Fields(OrderPlacedV2):
    channel: str  # no default: v3 cannot read v1/v2 data (BACKWARD breaks)


# The record name is the class name: v3 keeps it, as a real change of the model would.
OrderPlacedV3 = type("OrderPlaced", (_V3Fields,), {"__module__": __name__})


def _v3(orders: Orders) -> Registry:
    registry = Registry(topic_prefix=orders.v2.registry.topic_prefix)
    registry.register(
        OrderPlacedV3, name="order.placed", key="order_id", aggregate="order", version=3,
        encoding="avro-confluent",
    )  # fmt: skip
    export_schemas(registry, orders.catalog_dir)
    return registry


def test_the_registry_refuses_an_incompatible_version_and_check_reports_it(
    orders: Orders, client: SchemaRegistryClient
) -> None:
    assert check_registry(client, orders.v2.registry) == [
        RegistryVerdict("order.placed", 2, orders.subject, None)
    ], "no version registered yet: nothing to break"
    list(register_catalog(client, orders.v2.registry, orders.catalog()))
    client.set_compatibility(orders.subject, "BACKWARD")
    v3 = _v3(orders)  # committed next to v1 and v2
    [compatible] = check_registry(client, orders.v2.registry)
    assert compatible.compatible is True
    [refused] = check_registry(client, v3)
    assert (refused.event_type, refused.version, refused.compatible) == ("order.placed", 3, False)

    outcomes: list[Any] = []
    with pytest.raises(IncompatibleVersionError) as caught:
        outcomes.extend(register_catalog(client, v3, orders.catalog()))
    message = str(caught.value)
    assert "'order.placed' v3" in message and repr(orders.subject) in message
    assert "\n" not in message
    assert [(r.version, r.outcome) for r in outcomes] == [
        (1, RegistrationResult.EXISTS),
        (2, RegistrationResult.EXISTS),
    ]
    assert client.get_versions(orders.subject) == [1, 2]


# -- a registry behind TLS and basic authentication --------------------------------------------


@dataclass(frozen=True)
class SecuredRegistry:
    url: str
    ca: Path
    client_certificate: Path
    client_key: Path


def _issue(directory: Path) -> tuple[Path, RegistryTls, Path, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (PEM)."""
    ca = throwaway_ca()

    def leaf(name: str, usage: x509.ObjectIdentifier) -> tuple[Path, Path]:
        key, certificate = signed_leaf(
            ca, name, usage, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        )
        certificate_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
        certificate_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return certificate_file, key_file

    ca_pem = directory / "ca.pem"
    ca_pem.write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    server = leaf("registry", ExtendedKeyUsageOID.SERVER_AUTH)
    client = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return ca_pem, RegistryTls(certificate=server[0], key=server[1]), *client


PASSWORD = "s3cret-registry-password"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRegistry]:
    directory = tmp_path_factory.mktemp("secured-registry")
    ca, tls, certificate, key = _issue(directory)
    node = SchemaRegistryNode(data_dir=directory / "node", tls=tls, users={"oncely": PASSWORD})
    node.start()
    try:
        yield SecuredRegistry(node.url, ca, certificate, key)
    finally:
        node.stop()


def _secured_settings(registry: SecuredRegistry, **changes: Any) -> SchemaSettings:
    values: dict[str, Any] = {
        "schema_registry_url": registry.url,
        "schema_registry_basic_auth_user_info": f"oncely:{PASSWORD}",
        "schema_registry_ssl_ca_location": registry.ca,
        "schema_registry_ssl_certificate_location": registry.client_certificate,
        "schema_registry_ssl_key_location": registry.client_key,
        **changes,
    }
    return SchemaSettings(**values)


def test_the_client_built_from_settings_reaches_a_registry_behind_tls_and_basic_auth(
    orders: Orders, secured: SecuredRegistry
) -> None:
    settings = _secured_settings(secured)
    client = schema_registry_client(settings)
    registered = list(register_catalog(client, orders.v2.registry, orders.catalog()))
    assert [r.outcome for r in registered] == [RegistrationResult.REGISTERED] * 2
    codec = codec_for(orders.v2.registry, settings)
    assert codec.warm() == {"order.placed": registered[1].schema_id}
    value, headers = codec.encode(orders.v2.model(order_id="o-1", amount=3, currency="CHF"))
    assert codec.decode(value, headers, expected=orders.v2.model).currency == "CHF"
    assert PASSWORD not in repr(settings)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"schema_registry_basic_auth_user_info": "oncely:wrong"}, "401"),
        ({"schema_registry_basic_auth_user_info": None}, "401"),
        ({"schema_registry_ssl_ca_location": None}, "could not be reached"),
    ],
    ids=["wrong-password", "no-credentials", "untrusted-certificate"],
)
def test_a_refused_connection_is_one_clear_error(
    orders: Orders, secured: SecuredRegistry, changes: dict[str, Any], expected: str
) -> None:
    client = schema_registry_client(_secured_settings(secured, **changes))
    with pytest.raises(RegistryUnavailableError, match=expected) as caught:
        list(register_catalog(client, orders.v2.registry, orders.catalog()))
    assert PASSWORD not in str(caught.value)
