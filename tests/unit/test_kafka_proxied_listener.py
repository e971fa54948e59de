"""The devstack broker's PROXIED listener: a TCP proxy in front of the node (S7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncely.devstack.kafka import KafkaNode, KafkaNodeConfig
from oncely.errors import DevstackError


def test_the_proxied_listener_is_bound_locally_and_advertised_as_the_proxy(tmp_path: Path) -> None:
    text = KafkaNodeConfig(
        data_dir=tmp_path, port=1, controller_port=2, proxied_by="127.0.0.1:9", proxied_port=3
    ).server_properties()
    assert (
        "listeners=PLAINTEXT://127.0.0.1:1,PROXIED://127.0.0.1:3,CONTROLLER://127.0.0.1:2\n" in text
    )
    assert "advertised.listeners=PLAINTEXT://127.0.0.1:1,PROXIED://127.0.0.1:9\n" in text
    assert "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT," in text
    assert ",PROXIED:PLAINTEXT\n" in text
    assert "inter.broker.listener.name=PLAINTEXT\n" in text


def test_without_a_proxy_nothing_changes(tmp_path: Path) -> None:
    node = KafkaNode(data_dir=tmp_path)
    assert node.proxied_listener is None
    assert "PROXIED" not in node.config.server_properties()


def test_a_proxied_node_gets_its_own_port_for_the_proxy_to_forward_to(tmp_path: Path) -> None:
    node = KafkaNode(data_dir=tmp_path, proxied_by="127.0.0.1:9")
    assert node.proxied_listener == f"127.0.0.1:{node.config.proxied_port}"
    assert node.proxied_listener != node.bootstrap_servers


@pytest.mark.parametrize("proxied_by", ["127.0.0.1", "a:b", "h:1,x:2"])
def test_a_malformed_proxy_address_is_refused(tmp_path: Path, proxied_by: str) -> None:
    config = KafkaNodeConfig(
        data_dir=tmp_path, port=1, controller_port=2, proxied_by=proxied_by, proxied_port=3
    )
    with pytest.raises(DevstackError, match="use host:port"):
        config.server_properties()
