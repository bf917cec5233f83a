"""Issue 33, item 3: deadlines through a real run (P = 2, sim executor, a requests file).

The pool holds one prompt at a time, so requests are done in the order rank 0's queue
offers them: by deadline under ``--policy edf`` (the deadline-less last), by arrival under
the default policy. Results say whether each deadline was met and the record reports the
SLO attainment.
"""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow

# file order a, b, c, d; deadlines in wall seconds after submission (1e-6: always missed)
DEADLINES = {"a": None, "b": 1000.0, "c": 500.0, "d": 1e-6}


@pytest.mark.parametrize("policy, order", [("edf", ["d", "c", "b", "a"]),
                                           ("default", ["a", "b", "c", "d"])])  # fmt: skip
def test_edf_serves_a_class_by_deadline_and_the_record_reports_attainment(
    run_wavepp, tmp_path, policy, order
):
    rng = np.random.default_rng(0)
    path = tmp_path / "requests.jsonl"
    with path.open("w") as f:
        for rid, due in DEADLINES.items():
            line = {"id": rid, "tokens": rng.integers(0, 30_000, 256).tolist()}
            if due is not None:
                line["deadline_s"] = due
            f.write(json.dumps(line) + "\n")
    record, _ = run_wavepp(2, "--executor", "sim", "--requests-file", str(path),
                           "--block-size", "32", "--capacity-blocks", "12", "--concurrency", "8",
                           "--time-scale", "0.05", "--policy", policy)  # fmt: skip
    rows = {r["id"]: r for r in record["requests"]}
    assert all(r["status"] == "done" for r in rows.values())
    assert sorted(rows, key=lambda rid: rows[rid]["completion_s"]) == order
    assert record["policy"]["queue_order"] == ("edf" if policy == "edf" else "fcfs")
    assert {rid: r.get("deadline_met") for rid, r in rows.items()} == {
        "a": None, "b": True, "c": True, "d": False}
    assert (record["deadlines_met"], record["deadline_requests"]) == (2, 3)
    assert record["slo_attainment"] == pytest.approx(2 / 3)
    assert all(leak["balanced"] for leak in record["leak_check"])
