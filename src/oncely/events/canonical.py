"""Schema identity: Parsing Canonical Form, the CRC-64-AVRO fingerprint, the committed file form.

Two schemas that parse data identically have one Parsing Canonical Form (the Avro
specification's normalisation: no docs, defaults or logical types; full names) and so one
fingerprint. The fingerprint is the 8-byte little-endian CRC-64-AVRO (Rabin) value that the
Avro single-object encoding puts after its ``C3 01`` marker.
"""

from __future__ import annotations

import json
from typing import Any

from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form

__all__ = ["canonical_form", "dump_avsc", "fingerprint"]


def canonical_form(schema: Any) -> str:
    """Return the Parsing Canonical Form of ``schema`` (a parsed JSON schema: dict, list or str)."""
    return str(to_parsing_canonical_form(schema))


def fingerprint(schema: Any) -> bytes:
    """Return the 8-byte little-endian CRC-64-AVRO fingerprint of ``schema``'s canonical form."""
    return bytes.fromhex(_fastavro_fingerprint(canonical_form(schema), "CRC-64-AVRO"))


def dump_avsc(schema: Any) -> str:
    """Return the committed ``.avsc`` text of ``schema``: the same bytes for the same schema.

    The form is ``json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False)`` plus a
    final newline: key order never depends on how the schema was built, and diffs stay readable.
    """
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
