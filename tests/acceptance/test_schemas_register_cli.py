"""``oncely schemas register`` and ``oncely schemas check --schema-registry-url`` run as a deploy
pipeline would, in subprocesses, against a real schema registry (Apicurio Registry, or
``ONCELY_TEST_SCHEMA_REGISTRY_URL``)."""

from __future__ import annotations

import json
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from oncely.devstack._process import free_port
from oncely.schemas.loader import schema_registry_client
from oncely.settings import SchemaSettings
from tests.helpers import oncely_process

pytestmark = pytest.mark.acceptance

FIELDS = {
    1: "",
    2: "    note: str | None = None\n",
    3: "    note: str | None = None\n    channel: str\n",  # no default: BACKWARD breaks
}


class Shop:
    """An application whose ``order.placed`` is avro-confluent, in a folder of its own."""

    def __init__(self, directory: Path, registry_url: str) -> None:
        self.directory = directory
        self.registry_url = registry_url
        self.prefix = f"shop{uuid.uuid4().hex[:10]}."
        self.subject = f"{self.prefix}order.placed-value"

    def write(self, version: int) -> None:
        source = f"""
            from pydantic import BaseModel

            from oncely.events import Registry

            registry = Registry(topic_prefix="{self.prefix}")


            @registry.event(
                "order.placed", key="order_id", aggregate="order", version={version},
                encoding="avro-confluent",
            )
            class OrderPlaced(BaseModel):
                order_id: str
            """
        (self.directory / "shop_events.py").write_text(textwrap.dedent(source) + FIELDS[version])

    def oncely(
        self, *args: str, url: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        command = ["schemas", *args, "--app", "shop_events:registry"]
        if url:
            command += ["--schema-registry-url", self.registry_url]
        return oncely_process(
            *command, cwd=self.directory, env=env, without=["ONCELY_SCHEMA"], timeout=60
        )

    def release(self, version: int) -> None:
        """Write ``version`` of the code and export it to the catalog (``./schemas``)."""
        self.write(version)
        exported = self.oncely("export", url=False)
        assert exported.returncode == 0, exported.stderr


@pytest.fixture
def shop(tmp_path: Path, schema_registry_url: str) -> Shop:
    return Shop(tmp_path, schema_registry_url)


@pytest.fixture
def client(schema_registry_url: str) -> SchemaRegistryClient:
    return schema_registry_client(SchemaSettings(schema_registry_url=schema_registry_url))


def test_register_is_a_repeatable_deploy_step(shop: Shop, client: SchemaRegistryClient) -> None:
    shop.release(1)
    dry = shop.oncely("register", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        f"missing    order.placed v1 (subject {shop.subject}, no id)"
    ]
    assert "dry run: nothing registered; 1 version(s) to register" in dry.stderr
    assert shop.subject not in client.get_subjects()

    first = shop.oncely("register")
    assert first.returncode == 0, first.stderr
    [line] = first.stdout.splitlines()
    assert line.startswith(f"registered order.placed v1 (subject {shop.subject}, id ")
    v1_id = client.lookup_schema(shop.subject, client.get_version(shop.subject, 1).schema).schema_id
    assert line.endswith(f"id {v1_id})")

    shop.release(2)
    second = shop.oncely("register", env={"ONCELY_SCHEMA_REGISTRY_URL": shop.registry_url})
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    assert lines[0] == f"exists     order.placed v1 (subject {shop.subject}, id {v1_id})"
    assert lines[1].startswith(f"registered order.placed v2 (subject {shop.subject}, id ")
    assert "1 registered, 1 already registered" in second.stderr

    again = shop.oncely("register", "--json")
    assert again.returncode == 0, again.stderr
    document = json.loads(again.stdout)
    assert document["dry_run"] is False
    assert [(r["version"], r["outcome"]) for r in document["registrations"]] == [
        (1, "exists"),
        (2, "exists"),
    ]
    assert document["registrations"][0]["schema_id"] == v1_id
    assert client.get_versions(shop.subject) == [1, 2]


def test_an_incompatible_version_is_refused_by_register_and_reported_by_check(
    shop: Shop, client: SchemaRegistryClient
) -> None:
    shop.release(1)
    shop.release(2)
    assert shop.oncely("register").returncode == 0
    client.set_compatibility(shop.subject, "BACKWARD")
    ok = shop.oncely("check")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (
        f"ok    order.placed v2 in the schema registry (subject {shop.subject}: compatible with "
        "its latest version)"
    ) in ok.stdout

    shop.release(3)
    # FORWARD: the catalog accepts v3 (v2 code reads v3 data), the registry's BACKWARD does not.
    check = shop.oncely("check", "--mode", "FORWARD")
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"BREAK order.placed: the schema registry finds v3 (code) incompatible with the latest "
        f"version of subject {shop.subject}"
    ) in check.stdout
    assert "1 refused by the schema registry" in check.stderr
    as_json = json.loads(shop.oncely("check", "--mode", "FORWARD", "--json").stdout)
    assert as_json["incompatibilities"] == []
    assert as_json["schema_registry"] == [
        {"event_type": "order.placed", "version": 3, "subject": shop.subject, "compatible": False}
    ]

    refused = shop.oncely("register")
    assert refused.returncode == 1
    [error] = refused.stderr.splitlines()
    assert error.startswith(
        f"error: the schema registry refused 'order.placed' v3 under subject '{shop.subject}' "
        "as incompatible"
    )
    assert [line.split()[0] for line in refused.stdout.splitlines()] == ["exists", "exists"]
    assert client.get_versions(shop.subject) == [1, 2]


def test_what_stops_register_is_one_line(shop: Shop) -> None:
    shop.release(1)
    no_url = shop.oncely("register", url=False)
    assert no_url.returncode == 2
    assert no_url.stderr.splitlines() == [
        "error: no schema registry URL: set ONCELY_SCHEMA_REGISTRY_URL (or --schema-registry-url)"
    ]

    shop.write(2)  # not exported
    unexported = shop.oncely("register")
    assert unexported.returncode == 2
    [line] = unexported.stderr.splitlines()
    assert "'order.placed' v2 is not in the schema catalog" in line
    assert "oncely schemas export" in line

    shop.write(1)
    nowhere = shop.oncely(
        "register", url=False,
        env={"ONCELY_SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"},
    )  # fmt: skip
    assert nowhere.returncode == 1
    [line] = nowhere.stderr.splitlines()
    assert line.startswith("error: the schema registry could not be reached")

    secret = shop.oncely(
        "register", url=False,
        env={"ONCELY_SCHEMA_REGISTRY_URL": "http://admin:hunter2@127.0.0.1:1/apis/ccompat/v7"},
    )  # fmt: skip
    assert secret.returncode == 2
    [line] = secret.stderr.splitlines()
    assert "ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO" in line
    assert "hunter2" not in secret.stderr + secret.stdout
