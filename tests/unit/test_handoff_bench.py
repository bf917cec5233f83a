"""``wavepp.bench.handoff``'s arithmetic: bandwidth from the wire time, one plain-copy
denominator per length, medians with their min-max, latency from the record's stamps."""

from __future__ import annotations

import pytest

from wavepp.bench.handoff import _row


def test_a_row_divides_each_stages_wire_bandwidth_by_one_plain_copy_median():
    handoffs = [
        {"stages": [{"bytes": 100, "wire_s": w0, "seconds": w0 + 0.5, "ended_at": 10.0},
                    {"bytes": 200, "wire_s": w1, "seconds": w1 + 0.1, "ended_at": 10.2}]}
        for w0, w1 in [(1.0, 1.0), (2.0, 4.0), (4.0, 2.0)]
    ]  # fmt: skip
    copies = [1.0, 0.5, 2.0]  # 100 bytes: 100, 200 and 50 B/s, median 100
    plain_bands = [[(100, 1.0), (200, 2.0)]] * 3
    row = _row(4096, 2, handoffs, copies, 100, plain_bands)
    assert row["plain_copy"]["gb_s"]["median"] == pytest.approx(100e-9)
    s0, s1 = row["stages"]
    assert s0["gb_s"] == pytest.approx({"median": 50e-9, "min": 25e-9, "max": 100e-9})
    assert s0["ratio"] == pytest.approx({"median": 0.5, "min": 0.25, "max": 1.0})
    assert s1["ratio"] == pytest.approx({"median": 1.0, "min": 0.5, "max": 2.0})
    assert s0["setup_s"]["median"] == pytest.approx(0.5)
    assert s1["plain_sender_library_receiver"]["ratio"]["median"] == pytest.approx(1.0)
    # the cache is whole when the later of the two acknowledgements comes
    assert row["latency_s"] == pytest.approx({"median": 4.1, "min": 1.3, "max": 4.3})
