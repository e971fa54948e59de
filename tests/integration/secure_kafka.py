"""A devstack broker with SCRAM-SHA-512 users and a TLS listener signed by a throwaway CA."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from oncely.devstack.kafka import KafkaNode, KafkaSecurity, KafkaTls

USER = "oncely"


def throwaway_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A CA key and its self-signed certificate, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "oncely test CA")])
    certificate = (
        _valid_for_a_day(x509.CertificateBuilder().subject_name(name).issuer_name(name), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, certificate


def signed_leaf(
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
    common_name: str,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A key and a certificate for ``names``, signed by ``ca``, for ``usage``."""
    ca_key, ca_certificate = ca
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    certificate = (
        _valid_for_a_day(builder.issuer_name(ca_certificate.subject), key)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, certificate


def _valid_for_a_day(
    builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.now(UTC)
    return (
        builder.public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
    )


def make_tls(directory: Path, *, keystore_password: str) -> tuple[Path, Path]:
    """A self-signed CA (PEM, for clients) and a broker keystore (PKCS12) for 127.0.0.1."""
    ca = throwaway_ca()
    key, cert = signed_leaf(
        ca,
        "localhost",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    ca_pem = directory / "ca.pem"
    ca_pem.write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    keystore = directory / "broker.p12"
    keystore.write_bytes(
        pkcs12.serialize_key_and_certificates(
            b"broker",
            key,
            cert,
            [ca[1]],
            serialization.BestAvailableEncryption(keystore_password.encode()),
        )
    )
    return ca_pem, keystore


@dataclass(frozen=True)
class SecureKafka:
    """How to reach the secured broker: one SCRAM user, its password, the CA."""

    node: KafkaNode
    password: str
    ca: Path

    @property
    def plaintext(self) -> str:
        return self.node.bootstrap_servers

    @property
    def sasl(self) -> str:
        assert self.node.sasl_bootstrap_servers is not None
        return self.node.sasl_bootstrap_servers

    @property
    def sasl_ssl(self) -> str:
        assert self.node.sasl_ssl_bootstrap_servers is not None
        return self.node.sasl_ssl_bootstrap_servers

    def env(self, *, tls: bool, password: str | None = None) -> dict[str, str]:
        """``ONCELY_KAFKA_*`` variables for the SASL (or SASL + TLS) listener."""
        env = {
            "ONCELY_KAFKA_BOOTSTRAP_SERVERS": self.sasl_ssl if tls else self.sasl,
            "ONCELY_KAFKA_SECURITY_PROTOCOL": "SASL_SSL" if tls else "SASL_PLAINTEXT",
            "ONCELY_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "ONCELY_KAFKA_SASL_USERNAME": USER,
            "ONCELY_KAFKA_SASL_PASSWORD": password or self.password,
        }
        if tls:
            env["ONCELY_KAFKA_SSL_CA_LOCATION"] = str(self.ca)
        return env

    def client_config(self, *, tls: bool) -> dict[str, str]:
        """The same as raw librdkafka settings."""
        config = {
            "bootstrap.servers": self.sasl_ssl if tls else self.sasl,
            "security.protocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": USER,
            "sasl.password": self.password,
        }
        if tls:
            config["ssl.ca.location"] = str(self.ca)
        return config


def start_secure_kafka(directory: Path, *, authorizer: bool = False) -> SecureKafka:
    """Start a broker with a PLAINTEXT, a SASL_PLAINTEXT and a SASL_SSL listener (and ACLs
    enforced, with ``authorizer``: see :class:`KafkaSecurity`)."""
    password = f"pw-{secrets.token_hex(12)}"
    keystore_password = f"ks-{secrets.token_hex(12)}"
    ca, keystore = make_tls(directory, keystore_password=keystore_password)
    node = KafkaNode(
        data_dir=directory / "kafka",
        heap="384m",
        security=KafkaSecurity(
            scram_users={USER: password},
            tls=KafkaTls(keystore=keystore, keystore_password=keystore_password),
            authorizer=authorizer,
        ),
    )
    node.start(timeout=120)
    return SecureKafka(node, password, ca)
