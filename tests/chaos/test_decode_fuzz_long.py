"""The decode fuzz campaign at scale (``make chaos``): ``ONCELY_FUZZ_EXAMPLES`` cases (100,000).

The property and the generators are those of ``tests/unit/test_decode_fuzz.py``, which runs a
short campaign in ``make test``: ``read_envelope`` + ``decode_event`` return ``Decoded`` or
``Undecodable`` and ``Codec.decode`` raises only ``DecodeError``, each case within hypothesis's
deadline.
"""

from __future__ import annotations

import os

import pytest

from tests.unit.test_decode_fuzz import run_campaign

EXAMPLES = int(os.environ.get("ONCELY_FUZZ_EXAMPLES", "100000"))


@pytest.mark.chaos
@pytest.mark.timeout(max(180, EXAMPLES // 50))
def test_decode_never_raises_anything_but_decode_error_at_scale() -> None:
    run_campaign(EXAMPLES)
