"""A :class:`~wavepp.handoff.receive.Handoff` as the cache ``transformers`` continues
from, and a reference decoder on top of it. ``transformers`` is imported lazily.

In transformers 5.24 and 5.25 every supported family decodes from a ``DynamicCache`` built
from the model's config; its layers are, per WavePP layer kind (T tokens, batch 1):

- ``A`` (Llama, MiniMax-M2, Qwen3-Next's full attention): a ``DynamicLayer`` with keys
  and values ``[1, KV, T, hd]`` — WavePP's ``k``/``v`` ``[T, KV, hd]`` transposed; both
  cache keys after RoPE (and after the q/k norms), as WavePP does.
- ``M`` (Kimi Linear's MLA): a ``DynamicLayer`` that holds the *compressed* latent, not
  per-head keys: keys ``[1, 1, T, kv_lora_rank]`` = kv_a_layernorm(latent) and values
  ``[1, 1, T, rope_dim]`` = the shared key part (Kimi's MLA has no RoPE); the attention
  expands them with ``kv_b_proj`` at every step. WavePP's ``latent`` row is the
  concatenation of the two, so this is a split.
- ``L`` (Kimi's KDA, Qwen3-Next's Gated DeltaNet): a ``LinearAttentionLayer`` with
  ``conv_states[0]`` ``[1, C, K]`` (channels q | k | v in WavePP's order, the last K
  inputs of the short convolution, oldest first) and ``recurrent_states[0]``
  ``[1, H, dk, dv]`` float32 — WavePP's ``delta`` with a batch dim. WavePP keeps only
  the K-1 inputs a next step reads; transformers' oldest column is never read when
  decoding (``causal_conv1d_update`` convolves the last K of state + new input), so it
  is filled with zeros. Since 5.25 such a layer also counts the tokens it has seen
  (``cumulative_length_linear``; the cache's ``get_seq_length`` reads it where layer 0 is
  recurrent, and ``generate`` places the next token by it): it is set to T, not to the K
  columns the conv state was written with.
"""

from __future__ import annotations

import torch

from wavepp.dtypes import FLOATS, name_of
from wavepp.handoff.assembly import Handoff
from wavepp.handoff.wire import fingerprint_from_hf_config


def _model_config(model) -> dict:
    return model.config.get_text_config(decoder=True).to_dict()


def check_model(handoff: Handoff, model) -> None:
    """ValueError unless ``handoff`` was computed for ``model``'s architecture and shapes
    (every fingerprint field but dtype: the tensors are cast to the model's dtype)."""
    dtype = name_of(model.dtype) if str(model.dtype).removeprefix("torch.") in FLOATS else "float32"
    mine = fingerprint_from_hf_config(_model_config(model), handoff.fingerprint.dtype)
    theirs = handoff.fingerprint
    for field in mine.__struct_fields__:
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            raise ValueError(f"handoff fingerprint {field} is {a!r}; the model ({dtype}) has {b!r}")


def to_transformers_cache(handoff: Handoff, model):
    """The ``DynamicCache`` that ``model`` (a ``transformers`` causal LM of the handoff's
    architecture) continues the handed-off prompt from, on the model's device."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    check_model(handoff, model)
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    device, dtype = model.device, model.dtype
    kinds = handoff.fingerprint.layer_kinds
    rank = handoff.fingerprint.kv_lora_rank
    for index, kind in enumerate(kinds):
        tensors = handoff.layers[index]
        layer = cache.layers[index]
        if kind == "A":  # k, v: [T, KV, hd] -> [1, KV, T, hd]
            keys = tensors["k"].to(device, dtype).permute(1, 0, 2)[None].contiguous()
            values = tensors["v"].to(device, dtype).permute(1, 0, 2)[None].contiguous()
            layer.update(keys, values)
        elif kind == "M":  # latent: [T, 1, rank + rope] -> [1, 1, T, rank], [1, 1, T, rope]
            latent = tensors["latent"].to(device, dtype).permute(1, 0, 2)[None]
            layer.update(latent[..., :rank].contiguous(), latent[..., rank:].contiguous())
        else:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                raise ValueError(f"layer {index} is recurrent here but {type(layer).__name__} "
                                 "in the model's cache")  # fmt: skip
            conv = tensors["conv"]  # [K-1, C] -> [1, C, K], a zero oldest column
            width, channels = conv.shape
            full = torch.zeros(1, channels, width + 1, dtype=dtype, device=device)
            full[0, :, 1:] = conv.to(device, dtype).T
            layer.update_conv_state(full, conv_kernel_size=width + 1)
            layer.update_recurrent_state(tensors["delta"].to(device, torch.float32)[None])
            _set_tokens_seen(layer, int(handoff.tokens.shape[0]))
    return cache


def _set_tokens_seen(layer, tokens: int) -> None:
    """A recurrent layer's count of the tokens behind its state, where the installed
    transformers keeps one (5.25 and later: ``update_conv_state`` adds the columns it is
    given, here K instead of the prompt's T)."""
    seen = getattr(layer, "cumulative_length_linear", None)
    if isinstance(seen, torch.Tensor):
        seen.fill_(tokens)


def from_transformers_cache(cache, model) -> dict[int, dict[str, torch.Tensor]]:
    """The inverse mapping: a transformers cache (batch 1) as WavePP-layout tensors per
    layer, ``{layer: {name: tensor}}`` — what a stage's band holds for those layers."""
    kinds = fingerprint_from_hf_config(_model_config(model), "float32").layer_kinds
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for i, kind in enumerate(kinds):
        layer = cache.layers[i]
        if kind == "A":  # [1, KV, T, hd] -> [T, KV, hd]
            layers[i] = {"k": layer.keys[0].transpose(0, 1).contiguous(),
                         "v": layer.values[0].transpose(0, 1).contiguous()}  # fmt: skip
        elif kind == "M":  # [1, 1, T, rank], [1, 1, T, rope] -> [T, 1, rank + rope]
            latent = torch.cat([layer.keys[0], layer.values[0]], dim=-1)
            layers[i] = {"latent": latent.transpose(0, 1).contiguous()}
        else:  # conv [1, C, K] -> [K-1, C] (the newest K-1 inputs); [1, H, dk, dv] -> [H, dk, dv]
            layers[i] = {
                "delta": layer.recurrent_states[0][0].float().contiguous(),
                "conv": layer.conv_states[0][0, :, 1:].T.float().contiguous(),
            }
    return layers


def native_cache(model, tokens) -> dict[int, dict[str, torch.Tensor]]:
    """transformers' own cache for the prompt ``tokens`` (one prefill), in WavePP's layout."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=model.device)[None]
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return from_transformers_cache(cache, model)


def continue_generation(
    handoff: Handoff,
    model,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_at_eos: bool = True,
    streamer=None,
) -> list[int]:
    """Up to ``max_new_tokens`` token ids continuing the handed-off prompt: the handoff's
    first token (the pipeline's argmax), then what ``model.generate`` produces from the
    rebuilt cache on input prompt + first token. ``temperature`` 0 is greedy (the tested
    path); above 0, plain multinomial sampling at that temperature (no top-k / top-p,
    ``seed`` seeds torch) from the second token on — the first token is always the
    pipeline's argmax. With ``stop_at_eos`` generation ends at the model's end-of-sequence
    token, as ``generate`` does; without, it never emits one before ``max_new_tokens``
    (``generate``'s ``min_new_tokens``), so exactly ``max_new_tokens`` come back.
    ``streamer`` goes to ``generate`` (it sees prompt + first token, then each new one)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} < 1")
    if temperature < 0:
        raise ValueError(f"temperature {temperature} < 0")
    first = handoff.first_token
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if max_new_tokens == 1 or (stop_at_eos and first in eos):
        return [first]
    cache = to_transformers_cache(handoff, model)
    ids = torch.cat([handoff.tokens, torch.tensor([first])]).to(model.device)[None]
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=max_new_tokens - 1,
            min_new_tokens=0 if stop_at_eos else max_new_tokens - 1,
            streamer=streamer,
            **sampling,
        )
    return [first, *out[0, ids.shape[1] :].tolist()]
