"""A tiny ``transformers`` Llama and the cache its own forward makes of a prompt: the
reference of the handoff's vLLM layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

BLOCK, VOCAB = 32, 512  # the handoff's block (vLLM's --block-size) and the vocabulary

def tiny_llama(path: Path):
    """A random two-layer Llama of ``VOCAB`` tokens saved by ``transformers`` at ``path``
    (shapes vLLM's CPU backend serves: heads of 32 dims); the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM CPU: head >= 32
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.1, torch_dtype="float32",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def prompt_cache(model, tokens: list[int]) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """The prompt's first token and, per layer, (k, v): [T, kv heads, head dim], keys after
    rotary embedding, from transformers' own forward."""
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # transformers 5 / 4
    # HF's [1, kv heads, T, head dim] -> WavePP's [T, kv heads, head dim]
    layers = [(layer.keys[0].transpose(0, 1).contiguous(),
               layer.values[0].transpose(0, 1).contiguous()) for layer in cache.layers]  # fmt: skip
    return int(out.logits[0, -1].argmax()), layers
