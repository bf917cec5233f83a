"""The real model across real ranks: first tokens and logits equal a plain full forward."""

import json

import numpy as np
import pytest

from wavepp.model import BUILTIN, random_weights, reference_logits

pytestmark = pytest.mark.slow


def write_requests(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.mark.parametrize("stages", [2, 4])
def test_requests_file_first_tokens_match_reference(run_wavepp, tmp_path, stages):
    cfg = BUILTIN["tiny-hybrid"]
    rng = np.random.default_rng(11)
    doc = rng.integers(0, cfg.vocab_size, 200).tolist()
    good = {
        "doc": doc,
        "turn": doc + rng.integers(0, cfg.vocab_size, 60).tolist(),
        "solo": rng.integers(0, cfg.vocab_size, 90).tolist(),
    }
    rows = [
        {"id": "doc", "tokens": good["doc"]},
        "this is not json",
        {"id": "empty", "tokens": []},
        {"id": "huge-id", "tokens": [1, 2, cfg.vocab_size + 5]},
        {"id": "turn", "tokens": good["turn"]},
        {"id": "doc", "tokens": [1, 2, 3]},
        {"id": "solo", "tokens": good["solo"]},
    ]
    path = tmp_path / "requests.jsonl"
    write_requests(path, rows)
    # Concurrency 1: "turn" runs after "doc" finished and reuses its cached prefix.
    record, stdout = run_wavepp(stages, "--model", "tiny-hybrid", "--requests-file", str(path),
                                "--concurrency", "1",
                                "--block-size", "16", "--budget", "64", "--snapshot-interval",
                                "4", "--seed", "3")  # fmt: skip
    assert "real model" in stdout and record["simulated"] is False
    # the default placement: measured at start-up, every unit on some stage
    placement = record["placement"]
    assert placement["how"] == "auto" and len(placement["layers"]) == stages
    assert sum(placement["layers"]) == cfg.num_layers and min(placement["layers"]) >= 0.5
    assert len(placement["predicted_stage_s"]) == stages and "cached" in placement["measured_on"]
    assert {r["line"]: r["error"].split(": ", 1)[1] for r in record["rejected"]} == {
        2: "Expecting value: line 1 column 1 (char 0)",
        3: "no tokens (need a non-empty list of token ids)",
        4: "1 token ids outside the vocabulary 0..511, e.g. 517",
        6: "duplicate request id 'doc'",
    }
    weights = random_weights(cfg, seed=3)
    results = {r["id"]: r for r in record["requests"]}
    assert set(results) == set(good)
    for rid, tokens in good.items():
        logits = reference_logits(cfg, weights, np.asarray(tokens))
        assert results[rid]["first_token"] == int(logits.argmax())
        assert abs(results[rid]["top_logit"] - float(logits.max())) <= 1e-4
    assert results["doc"]["cached_tokens"] == 0
    assert results["turn"]["cached_tokens"] == 192  # 12 full blocks, a snapshot at the end
    assert all(leak["balanced"] for leak in record["leak_check"])
