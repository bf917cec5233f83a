"""The probe benchmark's hybrid case runs and compares the floor search with the scan."""

import json

from benchmarks.probe import main


def test_hybrid_case_small(tmp_path):
    out = tmp_path / "probe.json"
    main(["--hybrid", "--hybrid-tokens", "8192", "--requests", "8", "--repeats", "1",
          "--json", str(out)])  # fmt: skip
    figures = json.loads(out.read_text())
    dense, sparse = figures["8k_dense"], figures["8k_sparse"]
    assert dense["blocks_hit_to_floor_p50"] < 16  # a snapshot every 16 blocks
    assert sparse["blocks_hit_to_floor_p50"] > dense["blocks_hit_to_floor_p50"]
    assert sparse["snapshots"] <= 8 < dense["snapshots"]  # junctions only
    for case in (dense, sparse):
        assert case["probe_p50_us"] > 0 and case["floor_linear_p50_us"] > 0
