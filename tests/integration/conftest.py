"""Fixtures of the integration modules beyond the suite's (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.secure_kafka import SecureKafka, start_secure_kafka


@pytest.fixture(scope="session")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    """A second devstack broker with SCRAM users, a TLS listener and ACLs enforced, started once
    for the modules that need one (the pipeline over SASL and TLS, the topics an ACL denies).

    Everyone may do what no ACL denies (:class:`~oncely.devstack.kafka.KafkaSecurity`), so the
    modules share it: a test that denies something denies it on a topic of its own.
    """
    kafka = start_secure_kafka(tmp_path_factory.mktemp("secure-kafka"), authorizer=True)
    yield kafka
    kafka.node.stop()
