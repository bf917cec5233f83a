"""DESIGN §3 and §10: the planes never stall each other; compute keeps its speed."""

import hashlib
import json

import pytest

from tests.helpers.run import torchrun
from wavepp.transport.frames import INLINE_MAX_BYTES

pytestmark = pytest.mark.slow


def test_planes_are_independent_and_compute_is_not_starved(tmp_path):
    out = tmp_path / "planes.json"
    torchrun(2, ["tests/integration/planes_script.py", str(out)], timeout=180)
    rank0, rank1 = json.loads(out.read_text())
    # A pending data-plane receive did not stall the 20 rounds: they finished first.
    assert rank1["rounds_at"] < rank1["data_at"]
    assert rank1["rounds_s"] < 5
    # A pending rounds broadcast did not stall the data plane: 10 waves arrived first.
    assert rank1["waves_at"] < rank1["broadcast_at"]
    # The compute thread kept its speed while rounds ran (starvation would be 10-1000x).
    for r in (rank0, rank1):
        assert r["rounds_during"] >= 1
        assert r["compute_with_rounds_s"] < 3 * r["compute_alone_s"] + 0.2, r
    # Every broadcast arrived whole on both ranks, short or long, and both ranks' inline
    # rooms grew alike, to the ceiling (a 300 KiB payload passed it).
    sent = [b"", b"x", bytes(range(256)) * 20, b"y" * (300 << 10), b"tail"]
    expected = [[len(p), hashlib.sha256(p).hexdigest()] for p in sent]
    assert rank0["broadcasts"] == rank1["broadcasts"] == expected
    assert rank0["inline"] == rank1["inline"] == INLINE_MAX_BYTES
