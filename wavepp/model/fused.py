"""``--compile``: a Llama-shaped layer's token-wise work through ``torch.compile``.

The profile of a stage on CPU puts about a tenth of its time in element-wise passes
(RMSNorm, rotary embedding, SiLU and the gate product, residual adds), each a separate
kernel reading and writing a ``[tokens, width]`` tensor. Compiled (Inductor, dynamic
shapes), each layer's work around attention becomes two fused functions of plain
tensors, shared by every layer of the same shapes:

- :func:`gqa_pre`: input RMSNorm, the q/k/v projection (one product), rotary embedding;
- :func:`swiglu_post`: output projection and residual, post-attention RMSNorm,
  SwiGLU MLP (gate and up one product) and residual.

Attention stays in :mod:`wavepp.model.attention` (compiled code never sees a block
table), so the cache effects are exactly the uncompiled ones. Only Llama-shaped layers
are fused (:func:`fusable`: GQA without q/k norms or output gate and with RoPE on every
head dim, a dense SwiGLU MLP, plain RMSNorms); every other kind runs eagerly, and so
does every layer of a stage split over tensor-parallel ranks, whose attention output
is all-reduced between the two functions. Waves of one token run the same functions
uncompiled (a size-1 dimension would be compiled again as a special case). Compiling
needs a C++ compiler on CPU (Triton on CUDA); it happens when the executor is built,
and Inductor caches the result across runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model.attention import to_queries
from wavepp.model.attn import GQAttention
from wavepp.model.common import RMSNorm, SwiGLU, apply_rope, rms_norm


def gqa_pre(x, norm_w, eps: float, qkv_w, cos, sin, heads: int, kv_heads: int,
            head_dim: int):  # fmt: skip
    """x: [T, d_model] -> q [T, H, hd] and k, v [T, KV, hd], rotary applied to q and k;
    qkv_w: q, k and v's weights as one (``GQAttention.fused_qkv``)."""
    h = rms_norm(x, norm_w, eps)
    n = x.shape[0]
    q, k, v = F.linear(h, qkv_w).split([heads * head_dim, kv_heads * head_dim,
                                        kv_heads * head_dim], dim=-1)  # fmt: skip
    q = apply_rope(q.view(n, heads, head_dim), (cos, sin))
    k = apply_rope(k.view(n, kv_heads, head_dim), (cos, sin))
    return q, k, v.view(n, kv_heads, head_dim)


def swiglu_post(x, attn, o_w, norm_w, eps: float, gate_up_w, down_w):
    """x: [T, d_model], attn: [T, H * hd] -> the layer's output [T, d_model];
    gate_up_w: gate and up's weights as one (``SwiGLU.gate_up``)."""
    x = x + F.linear(attn, o_w)
    h = rms_norm(x, norm_w, eps)
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


_COMPILED: dict[str, object] = {}


def _compiled(name: str):
    """The compiled form of ``gqa_pre`` or ``swiglu_post`` (one per process)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(globals()[name], dynamic=True)
    return _COMPILED[name]


def fusable(layer: nn.Module) -> bool:
    """A Llama-shaped layer: Llama's attention, a dense SwiGLU MLP, plain RMSNorms; not
    split over tensor-parallel ranks (whose partial sums are reduced between the fused
    functions)."""
    if not (layer.has_mixer and layer.has_ffn):  # half a layer (a stage boundary inside it)
        return False
    if layer.tp.size > 1:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        type(layer.mixer) is GQAttention
        and layer.mixer.llama_shaped
        and type(layer.ffn) is SwiGLU
        and layer.ffn.names == ("gate_proj", "up_proj", "down_proj")
        and all(type(norm) is RMSNorm and not norm.offset for norm in norms)
    )


class FusedLayer:
    """One Llama-shaped layer run as compiled pre-attention and post-attention work."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.pre, self.post = _compiled("gqa_pre"), _compiled("swiglu_post")

    def __call__(self, x: torch.Tensor, batch, pools, queries=None) -> torch.Tensor:
        """x: [T, d_model] -> [T, d_model] (or [R, d_model], the rows of ``queries``, as
        ``paged_forward``), the same as the eager layer to fp32 rounding."""
        layer, mixer, mlp = self.layer, self.layer.mixer, self.layer.ffn
        pre = self.pre if x.shape[0] > 1 else gqa_pre
        cos, sin = mixer.wave_rope(batch, x.dtype)
        norm = layer.input_layernorm
        q, k, v = pre(x, norm.weight, norm.eps, mixer.fused_qkv.weight(), cos, sin,
                      mixer.num_heads, mixer.num_kv_heads, mixer.head_dim)  # fmt: skip
        out = mixer.paged_attend(q, None, k, v, batch, pools, queries)
        _, x = to_queries(batch, queries, x)
        if not x.shape[0]:
            return x
        post = self.post if x.shape[0] > 1 else swiglu_post
        norm = layer.post_attention_layernorm
        return post(x, out, mixer.o_proj.weight, norm.weight, norm.eps, mlp.gate_up.weight(),
                    mlp.down_proj.weight)  # fmt: skip
