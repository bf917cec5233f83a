"""A tiny Llama made with Hugging Face transformers (random init, saved in the test):
WavePP loads it and its first tokens and logits match transformers' forward."""

import numpy as np
import pytest
import torch
import transformers

from tests.helpers.harness import Pipeline
from wavepp.model import BUILTIN, random_weights, reference_logits
from wavepp.model.checkpoint import load_checkpoint, write_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return model, path


def test_loaded_llama_matches_transformers(tiny_llama):
    model, path = tiny_llama
    cfg, weights = load_checkpoint(path)
    assert cfg.pattern == "AAAA" and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    rng = np.random.default_rng(3)
    doc = rng.integers(0, cfg.vocab_size, 150, dtype=np.int32)
    turn = np.concatenate([doc, rng.integers(0, cfg.vocab_size, 40, dtype=np.int32)])
    pipe = Pipeline(cfg, weights, num_stages=2, block_size=16, budget=64)
    pipe.run([("doc", doc)])
    points = pipe.run([("turn", turn)])
    assert points["turn"][0] == 9  # the 9 full blocks of doc are reused
    for rid, tokens in (("doc", doc), ("turn", turn)):
        with torch.inference_mode():
            expected = model(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0, -1]
        ours = pipe.logits(rid)
        diff = (ours - expected).abs().max().item()
        print(f"{rid}: max abs diff against transformers {diff:.2e}")
        assert diff <= 1e-4
        assert int(ours.argmax()) == int(expected.argmax())
        assert (reference_logits(cfg, weights, tokens) - expected).abs().max().item() <= 1e-4


def test_own_layout_round_trips_a_hybrid(tmp_path):
    cfg = BUILTIN["tiny-hybrid"]
    weights = random_weights(cfg, seed=5)
    write_checkpoint(tmp_path, cfg, weights)
    cfg2, weights2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)


def test_unsupported_architectures_are_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_checkpoint(tmp_path)
    for name in ("llama", "kimi_linear", "qwen3_next", "minimax_m2"):
        assert name in str(error.value)
