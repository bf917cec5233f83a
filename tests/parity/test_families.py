"""Kimi Linear, Qwen3-Next and MiniMax-M2 checkpoints saved by ``transformers``: the
pipelined, chunked, prefix-reused prefill at P = 1, 2, 4 (uneven splits too) gives
transformers' first tokens and its logits within 1e-4 (fp32)."""

import numpy as np
import pytest
import torch

from tests.helpers.families import MODELS, hf_last_logits, make_checkpoint
from tests.helpers.harness import Pipeline
from wavepp.model import ModelConfig, reference_logits
from wavepp.model.checkpoint import load_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request, tmp_path_factory):
    model, path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    cfg, weights = load_checkpoint(path)
    return request.param, model, cfg, weights


def test_config_reads_the_layer_kinds(family):
    name, _, cfg, _ = family
    assert isinstance(cfg, ModelConfig) and cfg.family == name
    expected = {"kimi_linear": "LLALA", "qwen3_next": "LLALA", "minimax_m2": "AAAA"}[name]
    assert cfg.pattern == expected


def test_reference_forward_matches_transformers(family):
    _, model, cfg, weights = family
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 90)
    expected = hf_last_logits(model, tokens)
    ours = reference_logits(cfg, weights, tokens)
    assert (ours - expected).abs().max().item() <= TOL
    assert expected.abs().max().item() > 0.5  # logits far from zero: the check means something


# "halves": stage boundaries between a layer's mixer and its MLP; "in-mixer": the first
# attention mixer split by rows between the two stages, 60 / 40 (wavepp.plan.placement)
SPLITS = {1: [None], 2: [None, "uneven", "halves", "in-mixer"], 4: [None, "halves"]}


@pytest.mark.parametrize(("stages", "split"), [(p, s) for p in (1, 2, 4) for s in SPLITS[p]])
def test_pipeline_matches_transformers(family, stages, split):
    name, model, cfg, weights = family
    counts = None
    if split == "uneven":
        counts = [1, cfg.num_layers - 1]
    elif split == "in-mixer":
        k = cfg.pattern.index("A")
        counts = [k + 0.3, cfg.num_layers - k - 0.3]
    elif split == "halves":
        counts = [1.5, cfg.num_layers - 1.5] if stages == 2 else [1.5, 1, cfg.num_layers - 3.5, 1]
    elif stages == 4 and cfg.num_layers == 5:
        counts = [2, 1, 1, 1]
    rng = np.random.default_rng(7)
    doc = rng.integers(0, cfg.vocab_size, 230, dtype=np.int32)  # 14 blocks + 6 tokens
    pipe = Pipeline(cfg, weights, stages, block_size=16, snapshot_interval=4, budget=96,
                    layers_per_stage=counts)  # fmt: skip
    recurrent = "L" in cfg.pattern

    def check(rid, tokens):
        expected = hf_last_logits(model, tokens)
        diff = (pipe.logits(rid) - expected).abs().max().item()
        assert diff <= TOL, f"{name} P={stages} {rid}: max abs diff {diff:.2e}"
        assert int(pipe.logits(rid).argmax()) == int(expected.argmax())

    # Cold: 230 tokens in waves of 96, so chunks split the request mid-block.
    assert pipe.run([("a", doc)])["a"][0] == 0
    check("a", doc)
    # Reuse at the request-end snapshot (block 14) of "a".
    turn = np.concatenate([doc, rng.integers(0, cfg.vocab_size, 70, dtype=np.int32)])
    assert pipe.run([("b", turn)])["b"][0] == 14
    check("b", turn)
    # Shares 10 blocks; recurrent stages clamp to the interval snapshot at 8. Together
    # with a cold request in the same waves.
    fork = np.concatenate([doc[:160], rng.integers(0, cfg.vocab_size, 50, dtype=np.int32)])
    other = rng.integers(0, cfg.vocab_size, 40, dtype=np.int32)
    points = pipe.run([("c", fork), ("d", other)])
    assert points["c"][0] == (8 if recurrent else 10)
    assert points["d"][0] == 0
    check("c", fork)
    check("d", other)
    report = pipe.stages[-1].executor.memory_report()
    assert report["kv_pool_bytes"] > 0
    if recurrent:
        assert sum(st.executor.memory_report()["snapshot_bytes"] for st in pipe.stages) > 0


def test_state_of_a_recurrent_layer_resumes_from_any_cut(family):
    """Snapshots hold the delta state and the convolution state: resuming from the state
    at any cut equals the uncut run."""
    _, _, cfg, weights = family
    if "L" not in cfg.pattern:
        pytest.skip("attention-only family")
    from wavepp.model import build_stage

    stage = build_stage(cfg, range(cfg.num_layers), True, True, weights)
    mixer = stage.layer(0).mixer
    h = torch.randn(100, cfg.d_model, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole, _, cuts = mixer.chunk(h, None, (16, 37, 64))
        for cut, state in zip((16, 37, 64), cuts, strict=True):
            rest, _, _ = mixer.chunk(h[cut:], state, ())
            assert (rest - whole[cut:]).abs().max().item() <= 1e-5
        assert (mixer.full(h) - whole).abs().max().item() <= 1e-5


def test_builtin_tiny_kimi_is_a_kimi_linear_checkpoint(tmp_path):
    """``python -m wavepp.model.checkpoint --model tiny-kimi`` writes a directory that
    loads back to the same model and that transformers runs to the same logits."""
    import transformers

    from wavepp.model import BUILTIN, random_weights
    from wavepp.model.checkpoint import write_checkpoint

    cfg = BUILTIN["tiny-kimi"]
    weights = random_weights(cfg, seed=2)
    write_checkpoint(tmp_path, cfg, weights)
    cfg2, weights2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg and all(torch.equal(weights[k], weights2[k]) for k in weights)
    model = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 70)
    expected = hf_last_logits(model, tokens)
    assert (reference_logits(cfg, weights, tokens) - expected).abs().max() <= TOL
