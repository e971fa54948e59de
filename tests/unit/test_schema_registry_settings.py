"""The schema registry's settings, the client configuration they give, and the local registry's
pure parts (Java lookup, server settings). The registry itself is exercised for real in
``tests/integration/test_schema_registry.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from oncely.devstack import registry as devstack_registry
from oncely.devstack.registry import RegistryTls, SchemaRegistryNode, find_java
from oncely.errors import ConfigurationError, ToolMissingError
from oncely.settings import SchemaSettings
from tests.helpers import oncely_cli

SECRET = "p4ss-w0rd-never-shown"
REPO = Path(__file__).resolve().parents[2]


def test_settings_read_the_environment_into_the_client_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_URL", "https://registry:8081")
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO", f"svc:{SECRET}")
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_SSL_CA_LOCATION", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_SSL_CERTIFICATE_LOCATION", str(tmp_path / "c.pem"))
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_SSL_KEY_LOCATION", str(tmp_path / "c.key"))
    monkeypatch.setenv("ONCELY_SCHEMA_REGISTRY_AUTO_REGISTER", "true")
    settings = SchemaSettings()
    assert settings.schema_registry_auto_register is True
    assert settings.schema_registry_config() == {
        "url": "https://registry:8081",
        "basic.auth.user.info": f"svc:{SECRET}",
        "ssl.ca.location": str(tmp_path / "ca.pem"),
        "ssl.certificate.location": str(tmp_path / "c.pem"),
        "ssl.key.location": str(tmp_path / "c.key"),
    }
    for text in (repr(settings), str(settings)):
        assert SECRET not in text


def test_stage_registers_nothing_unless_told() -> None:
    assert SchemaSettings().schema_registry_auto_register is False
    assert SchemaSettings(schema_registry_url="http://r").schema_registry_config() == {
        "url": "http://r"
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"schema_registry_url": f"http://svc:{SECRET}@registry"}, "carries credentials"),
        ({"schema_registry_basic_auth_user_info": SECRET}, "must be user:password"),
        ({"schema_registry_ssl_certificate_location": "c.pem"}, "or neither"),
        ({"schema_registry_ssl_key_location": f"{SECRET}.key"}, "or neither"),
    ],
    ids=["credentials-in-url", "user-info-without-colon", "certificate-alone", "key-alone"],
)
def test_bad_registry_settings_are_refused_without_echoing_them(
    values: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        SchemaSettings(**values)  # type: ignore[arg-type]
    assert SECRET not in str(caught.value)


def test_a_client_without_a_url_names_the_setting() -> None:
    with pytest.raises(ConfigurationError, match="ONCELY_SCHEMA_REGISTRY_URL"):
        SchemaSettings().schema_registry_config()


def test_the_command_line_reports_a_bad_setting_in_one_line_without_the_secret() -> None:
    result = oncely_cli(
        "schemas", "check", "--app", "examples.payments.events:registry",
        "--dir", str(REPO / "schemas"), "--schema-registry-url", "http://127.0.0.1:1",
        env={"ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO": SECRET},
    )  # fmt: skip
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert "ONCELY_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO must be user:password" in line
    assert SECRET not in result.output


def _fake_java(directory: Path, version: str) -> Path:
    directory.mkdir(parents=True)
    java = directory / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2026-01-20' >&2\n")
    java.chmod(0o755)
    return java


def test_find_java_takes_the_first_new_enough_jdk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(_fake_java(tmp_path / "path", "17.0.15").parent))
    monkeypatch.setattr(devstack_registry, "_JVM_DIRS", tmp_path / "jvm")
    old = _fake_java(tmp_path / "jvm" / "jdk-11" / "bin", "11.0.2")
    with pytest.raises(ToolMissingError, match=r"Java 21\+") as caught:
        find_java()
    assert f"{old} (11)" in str(caught.value) and "(17)" in str(caught.value)
    assert "JAVA_HOME" in str(caught.value)
    new = _fake_java(tmp_path / "jvm" / "temurin-25" / "bin", "25.0.3")
    assert find_java() == str(new)
    home = _fake_java(tmp_path / "home" / "bin", "21.0.1")
    monkeypatch.setenv("JAVA_HOME", str(home.parent.parent))
    assert find_java() == str(home)


def test_a_secured_registry_serves_https_with_basic_users(tmp_path: Path) -> None:
    tls = RegistryTls(certificate=tmp_path / "c.pem", key=tmp_path / "c.key")
    node = SchemaRegistryNode(data_dir=tmp_path, tls=tls, users={"svc": SECRET})
    assert node.url == f"https://127.0.0.1:{node.port}/apis/ccompat/v7"
    settings = node.system_properties()
    assert settings["quarkus.http.ssl-port"] == str(node.port)
    assert settings["quarkus.http.insecure-requests"] == "disabled"
    assert settings["quarkus.http.ssl.certificate.files"] == str(tls.certificate)
    assert settings["quarkus.security.users.embedded.users.svc"] == SECRET
    assert settings["quarkus.management.port"] == str(node.management_port)
    plain = SchemaRegistryNode(data_dir=tmp_path)
    assert plain.url == f"http://127.0.0.1:{plain.port}/apis/ccompat/v7"
    assert not any(key.startswith("quarkus.http.ssl") for key in plain.system_properties())
