"""Issue 9: eager rungs (R1, R2) on hybrid stages with a tiny pool — admission evicts
while other requests compute and save snapshots — run many rounds without a missing
snapshot and end balanced on every stage."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("rung", ["R1", "R2"])
def test_eager_rungs_with_a_tiny_pool_and_hybrid_layers(run_wavepp, tmp_path, rung):
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(0, 512, int(n)).tolist() for n in (40, 72, 104)]
    rows = []
    for i in range(36):
        suffix = rng.integers(0, 512, int(rng.integers(8, 60))).tolist()
        rows.append({"id": f"r{i}", "tokens": prefixes[i % 3] + suffix})
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 12 blocks of 16 tokens: two requests fill the pool, so nearly every admission
    # evicts blocks (and their snapshots) other requests published moments before.
    record, _ = run_wavepp(2, "--model", "tiny-hybrid", "--requests-file", str(path),
                           "--rung", rung, "--capacity-blocks", "12", "--block-size", "16",
                           "--snapshot-interval", "1", "--concurrency", "3",
                           "--budget", "48", "--min-budget", "16")  # fmt: skip
    assert record["failed_requests"] == 0
    assert all(r["status"] == "done" for r in record["requests"])
    assert record["admission_rounds"] >= 36
    for leak in record["leak_check"]:
        assert leak["balanced"], leak
