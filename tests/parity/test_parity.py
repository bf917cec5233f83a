"""The pipelined, chunked, prefix-reused prefill equals one plain full forward (fp32)."""

import attrs
import numpy as np
import pytest
import torch

from tests.helpers.harness import Pipeline
from wavepp.model import BUILTIN, random_weights, reference_logits


def _shrink(cfg):
    if cfg.family == "kimi_linear":
        return attrs.evolve(cfg, d_model=64, d_ff=128, kv_lora_rank=32, nope_dim=16, rope_dim=8,
                            v_dim=16, linear_k_dim=16, linear_v_dim=16, d_expert=32,
                            shared_ff=32)  # fmt: skip
    linear = 16 if "L" in cfg.pattern else 0
    return attrs.evolve(cfg, d_model=64, d_ff=128, head_dim=16, rotary_dim=16,
                        linear_k_dim=linear, linear_v_dim=linear)  # fmt: skip


SMALL = {name: _shrink(cfg) for name, cfg in BUILTIN.items()}
TOL = 1e-4


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_chunked_prefix_reused_pipeline_matches_full_forward(name, stages):
    torch.manual_seed(0)
    cfg = SMALL[name]
    weights = random_weights(cfg, seed=1)
    rng = np.random.default_rng(7)
    doc = rng.integers(0, cfg.vocab_size, 230, dtype=np.int32)  # 14 blocks + 6 tokens
    pipe = Pipeline(cfg, weights, stages, block_size=16, snapshot_interval=4, budget=96)
    worst = 0.0

    def check(rid, tokens):
        nonlocal worst
        ref = reference_logits(cfg, weights, tokens)
        diff = (pipe.logits(rid) - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"{rid}: max abs diff {diff:.2e}"
        assert int(pipe.logits(rid).argmax()) == int(ref.argmax())

    # Cold: 230 tokens in waves of 96, so chunks split the request.
    points = pipe.run([("a", doc)])
    assert points["a"][0] == 0
    check("a", doc)
    # Reuse: a follow-up turn. Attention-only stages reuse all 14 cached blocks; stages
    # with L layers clamp to the last snapshot: the request end (14) is one.
    turn = np.concatenate([doc, rng.integers(0, cfg.vocab_size, 70, dtype=np.int32)])
    points = pipe.run([("b", turn)])
    assert points["b"][0] == 14
    check("b", turn)
    # Clamped reuse: shares only the first 10 blocks; no snapshot at 10, so hybrid
    # stages fall back to the interval snapshot at 8. Two requests in the same waves.
    fork = np.concatenate([doc[:160], rng.integers(0, cfg.vocab_size, 50, dtype=np.int32)])
    other = rng.integers(0, cfg.vocab_size, 40, dtype=np.int32)
    points = pipe.run([("c", fork), ("d", other)])
    assert points["c"][0] == (8 if "L" in cfg.pattern else 10)
    assert points["d"][0] == 0
    check("c", fork)
    check("d", other)
    print(f"{name} P={stages}: max abs diff {worst:.2e}")
