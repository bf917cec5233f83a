"""Bands of a prompt's cache for the handoff tests, two ways: from transformers' own
prefill cache (the inverse of ``wavepp.handoff.hf``'s mapping) and from WavePP's own
layers (what a stage holds), both in WavePP's native layout."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.families import MODELS, VOCAB, make_checkpoint, redraw
from wavepp.handoff.client import build_band
from wavepp.handoff.hf import from_transformers_cache
from wavepp.handoff.wire import fingerprint_from_hf_config
from wavepp.model import build_stage
from wavepp.model.checkpoint import load_checkpoint

FAMILIES = ("llama", *MODELS)


def llama_config(num_layers: int = 4) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def make_model(family: str, path: Path, seed: int = 0):
    """(transformers model in eval mode, the directory it was saved to)."""
    if family != "llama":
        return make_checkpoint(family, path, seed)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    redraw(model, seed)
    model.save_pretrained(path)
    return model, path


def config_dict(model) -> dict:
    return model.config.to_dict()


@torch.inference_mode()
def hf_prefill(model, tokens: torch.Tensor):
    """(transformers' cache after the prompt, the prompt's last logits)."""
    out = model(tokens[None], use_cache=True)
    return out.cache if hasattr(out, "cache") else out.past_key_values, out.logits[0, -1]


def layers_from_hf_cache(model, cache) -> dict[int, dict[str, torch.Tensor]]:
    """WavePP-layout tensors per layer from transformers' cache (the inverse mapping)."""
    return from_transformers_cache(cache, model)


@torch.inference_mode()
def layers_from_wavepp(path: Path, tokens: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """The same tensors from WavePP's own layers (one full forward, float32)."""
    cfg, weights = load_checkpoint(path)
    model = build_stage(cfg, range(cfg.num_layers), True, True, weights)
    x = model.model.embed_tokens(tokens)  # [T, d_model]
    positions = torch.arange(tokens.shape[0])
    layers = {}
    for i in model.layer_ids:
        layer = model.layer(i)
        mixer = layer.mixer
        h = layer.input_layernorm(x)
        if mixer.paged:
            _, entries = mixer.project(h, positions)
            if "latent" in mixer.cache_layout():  # [T, rank + rope]
                layers[i] = {"latent": entries[:, None, :]}
            else:  # [T, 2, KV, hd]
                layers[i] = {"k": entries[:, 0], "v": entries[:, 1]}
        else:
            _, state, _ = mixer.chunk(h, None)
            layers[i] = {"delta": state["delta"], "conv": state["conv"]}
        x = x + mixer.full(h)
        x = x + layer.ffn(layer.post_attention_layernorm(x))
    return layers


def split_bands(model, request_id: str, tokens: torch.Tensor, layers, first_token: int,
                top_logit: float, sizes: list[int]):  # fmt: skip
    """The bands of P = len(sizes) stages holding sizes[s] consecutive layers each."""
    fp = fingerprint_from_hf_config(config_dict(model), "float32")
    assert sum(sizes) == fp.num_layers
    bands, start = [], 0
    for stage, size in enumerate(sizes):
        tensors = {}
        if stage == 0:
            tensors[(-1, "tokens")] = tokens.to(torch.int32)
        for i in range(start, start + size):
            for name, tensor in layers[i].items():
                tensors[(i, name)] = tensor
        last = stage == len(sizes) - 1
        first, top = (first_token, top_logit) if last else (-1, 0.0)
        bands.append(build_band(request_id, stage, len(sizes), fp, tensors, tokens.shape[0],
                                first, top))  # fmt: skip
        start += size
    return bands
