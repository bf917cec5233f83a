"""In-flight prefix sharing on the real executor (issue 14): requests held back for a
producer still running resume from its blocks and from the snapshots it saved where
they branch, and their first tokens equal a plain full forward."""

import json

import numpy as np
import pytest

from wavepp.model import BUILTIN, random_weights, reference_logits

pytestmark = pytest.mark.slow


def test_waiters_resume_where_they_branch_off_a_running_producer(run_wavepp, tmp_path):
    cfg = BUILTIN["tiny-hybrid"]
    rng = np.random.default_rng(5)

    def fresh(n):
        return rng.integers(0, cfg.vocab_size, n).tolist()

    doc = fresh(300)  # 18 full blocks of 16
    a = doc[:80] + fresh(20)  # branches off doc after 5 blocks (not a snapshot interval)
    other = fresh(200)
    tokens = {
        "doc": doc,
        "a": a,
        "b": doc[:183] + fresh(30),  # shares 11 full blocks, then differs inside block 11
        "c": doc + fresh(40),  # extends the whole of doc
        "d": a + fresh(25),  # shares a's 6 blocks: waits for doc, then for a
        "other": other,
        "e": other[:112] + fresh(10),  # its producer is cancelled: it computes itself
    }
    rows = [{"id": rid, "tokens": t} for rid, t in tokens.items()]
    rows.append({"cancel": "other", "after_s": 0.0})
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Every request is submitted at once: one round offers doc, the others wait for it
    # (the "patient" policy waits past the recompute bound, so the test does not depend
    # on the machine's speed).
    record, _ = run_wavepp(2, "--model", "tiny-hybrid", "--requests-file", str(path),
                           "--concurrency", "8", "--block-size", "16", "--budget", "64",
                           "--min-budget", "64", "--snapshot-interval", "4", "--seed", "4",
                           "--policy", "tests.integration.custom:patient")  # fmt: skip
    weights = random_weights(cfg, seed=4)
    results = {r["id"]: r for r in record["requests"]}
    for rid, t in tokens.items():
        if results[rid]["status"] != "done":
            assert rid == "other" and results[rid]["status"] == "cancelled"
            continue
        logits = reference_logits(cfg, weights, np.asarray(t))
        assert results[rid]["first_token"] == int(logits.argmax()), rid
        assert abs(results[rid]["top_logit"] - float(logits.max())) <= 1e-4, rid
    cached = {rid: results[rid]["cached_tokens"] for rid in ("doc", "a", "b", "c", "d")}
    assert cached == {"doc": 0, "a": 80, "b": 176, "c": 288, "d": 96}
    assert results["e"]["status"] == "done"
    assert all(leak["balanced"] for leak in record["leak_check"])
