"""Avro single-object encoding framing: ``C3 01``, the writer schema's fingerprint, the body.

Per the Avro specification, a single-object encoded value is the two-byte marker ``C3 01``,
the 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form,
then the Avro binary encoding of the datum. The reader finds the writer schema by fingerprint.
"""

from __future__ import annotations

from oncely.schemas.errors import DecodeError, DecodeFailure

__all__ = ["HEADER_SIZE", "MARKER", "frame", "unframe"]

MARKER = b"\xc3\x01"
HEADER_SIZE = len(MARKER) + 8


def frame(fingerprint: bytes, body: bytes) -> bytes:
    """Return the single-object encoding of ``body`` written with the schema of ``fingerprint``."""
    if len(fingerprint) != 8:
        raise ValueError(f"a CRC-64-AVRO fingerprint has 8 bytes, not {len(fingerprint)}")
    return MARKER + fingerprint + body


def unframe(value: bytes) -> tuple[bytes, bytes]:
    """Split a single-object encoded ``value`` into (fingerprint, body).

    Raises:
        DecodeError: (``corrupt``) the value is shorter than the header or lacks the marker.
    """
    if len(value) < HEADER_SIZE:
        raise DecodeError(
            DecodeFailure.CORRUPT,
            f"{len(value)} bytes are too short for an Avro single-object header "
            f"({HEADER_SIZE} bytes)",
        )
    if value[:2] != MARKER:
        raise DecodeError(
            DecodeFailure.CORRUPT,
            f"value starts with {value[:2].hex()}, not the Avro single-object marker c301",
        )
    return value[2:HEADER_SIZE], value[HEADER_SIZE:]
