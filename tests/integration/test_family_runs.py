"""A checkpoint of each family (Kimi Linear, Qwen3-Next, MiniMax-M2) saved by
transformers, run by ``torchrun -m wavepp.main`` on two ranks with a requests file and
layers split unevenly: first tokens equal transformers' argmax, a follow-up turn reuses
the first prompt's cached blocks (for the hybrids, from its snapshot at the request end),
and a --layers-per-stage that does not fit the model fails with the numbers."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.families import hf_last_logits, make_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family,split", [("kimi_linear", "2,3"), ("qwen3_next", "3,2"),
                                          ("minimax_m2", "1,3")])  # fmt: skip
def test_family_checkpoint_runs_on_two_ranks(run_wavepp, tmp_path, family, split):
    model, path = make_checkpoint(family, tmp_path / family)
    rng = np.random.default_rng(4)
    doc = rng.integers(0, 300, 200).tolist()
    prompts = {"doc": doc, "turn": doc + rng.integers(0, 300, 60).tolist(),
               "solo": rng.integers(0, 300, 90).tolist()}  # fmt: skip
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": k, "tokens": v}) + "\n"
                                for k, v in prompts.items()))  # fmt: skip
    # Concurrency 1: "turn" runs after "doc" and resumes from its request-end snapshot.
    record, _ = run_wavepp(2, "--model", str(path), "--requests-file", str(requests),
                           "--concurrency", "1", "--block-size", "16", "--budget", "64",
                           "--snapshot-interval", "4", "--layers-per-stage", split)  # fmt: skip
    results = {r["id"]: r for r in record["requests"]}
    for rid, tokens in prompts.items():
        expected = hf_last_logits(model, np.asarray(tokens))
        assert results[rid]["first_token"] == int(expected.argmax())
        assert abs(results[rid]["top_logit"] - float(expected.max())) <= 1e-4
    assert results["turn"]["cached_tokens"] == 192  # 12 full blocks of "doc"
    assert all(leak["balanced"] for leak in record["leak_check"])


def test_layers_per_stage_must_sum_to_the_models_layers(tmp_path):
    _, path = make_checkpoint("kimi_linear", tmp_path / "kimi")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "wavepp.main", "--model", str(path), "--layers-per-stage", "2,2",
         "--requests", "2", "--no-progress"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--layers-per-stage 2,2 sums to 4 layers; the model has 5" in proc.stderr
