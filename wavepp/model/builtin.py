"""A decoder LM from a config: attention (A) and gated linear attention (L) layers.

Pure-attention configs follow the Llama layout and its weight names, so Llama-family
checkpoints load as they are; hybrid configs add ``linear_attn`` layers under the same
naming scheme. The published families (Kimi Linear, Qwen3-Next, MiniMax-M2) live in
``wavepp.model``; ``BUILTIN``, :func:`random_weights`, :func:`build_stage` and
:func:`reference_logits` take either kind of config.

The layer-kind seam the executor relies on (every mixer, here and in the families):

- a **paged** kind (``paged = True``) declares ``cache_layout() -> {name: entry shape}``,
  the per-token entries it keeps in the paged pool (``k``/``v`` ``[KV, hd]`` for GQA, a
  compressed ``latent`` ``[1, rank + rope]`` for MLA), and runs a whole wave with
  ``paged_forward(h [T, d_model], batch, pools, attention, queries=None) -> [T, d_model]``:
  it writes every new token's entries, and with ``queries``
  (``PagedBatch.last_tokens``) attends for those rows only and returns ``[R, d_model]``;
- a **recurrent** kind (``paged = False``) declares ``state_shapes() -> {part: shape}``
  (e.g. the delta-rule state and the short convolution's state) and runs one chunk with
  ``chunk(h [n, d_model], state | None, cuts) -> (out, state after, [state at cut])``,
  the states at ``cuts`` (token offsets) being what snapshots keep.

Everything here is plain PyTorch. The paged, chunked, prefix-reusing forward is in
``wavepp.exec.torch_exec``; :func:`reference_logits` is the plain full forward the
parity tests compare it with.
"""

from __future__ import annotations

import itertools
import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model import (
    FamilyConfig,
    build_family_stage,
    family_random_weights,
    family_reference_logits,
)
from wavepp.model.attention import to_queries, write_paged
from wavepp.model.attn import masked_attention
from wavepp.model.common import StageBase


@attrs.frozen
class ModelConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    pattern: str  # layer kinds, repeated: "A" (Llama), "LLLA" (hybrid)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    linear_heads: int = 0  # L layers: heads, each with a head_dim x head_dim state
    linear_head_dim: int = 0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def kind(self, layer: int) -> str:
        return self.pattern[layer % len(self.pattern)]

    def validate(self) -> None:
        if set(self.pattern) - set(MIXERS):
            raise ValueError(
                f"unknown layer kinds in pattern {self.pattern!r}; known: {sorted(MIXERS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} heads do not group over {self.num_kv_heads} KV heads"
            )
        if "L" in self.pattern and not (self.linear_heads and self.linear_head_dim):
            raise ValueError("a pattern with L layers needs linear_heads and linear_head_dim")


BUILTIN: dict[str, ModelConfig | FamilyConfig] = {
    # The embedded default: Kimi-Linear-shaped (KDA + MLA with a latent KV pool, MoE with
    # a shared expert), small enough for four ranks on two CPU cores.
    "tiny-kimi": FamilyConfig(
        family="kimi_linear", vocab_size=512, d_model=128, num_layers=8,
        mixers=("kda", "kda", "kda", "mla") * 2, mlps=("dense",) + ("moe",) * 7,
        norm_eps=1e-5, num_heads=4, kv_lora_rank=64, nope_dim=32, rope_dim=16, v_dim=32,
        linear_heads=4, linear_k_dim=32, linear_v_dim=32, conv_kernel=4, d_ff=256,
        num_experts=8, top_k=2, d_expert=64, shared_ff=64, routed_scaling=2.0,
        num_groups=2, topk_groups=1,
    ),
    # The earlier default: gated linear attention + GQA, four ranks on two CPU cores.
    "tiny-hybrid": ModelConfig(
        vocab_size=512, d_model=128, num_layers=8, pattern="LLLA", num_heads=4,
        num_kv_heads=2, head_dim=32, d_ff=256, linear_heads=4, linear_head_dim=32,
    ),
    "tiny-llama": ModelConfig(
        vocab_size=512, d_model=128, num_layers=8, pattern="A", num_heads=4,
        num_kv_heads=2, head_dim=32, d_ff=256,
    ),
    # For the CPU benchmarks: big enough that the math, not the runtime, dominates.
    "small-llama": ModelConfig(
        vocab_size=4096, d_model=512, num_layers=8, pattern="A", num_heads=8,
        num_kv_heads=2, head_dim=64, d_ff=1536,
    ),
    "small-hybrid": ModelConfig(
        vocab_size=4096, d_model=512, num_layers=8, pattern="LLLA", num_heads=8,
        num_kv_heads=2, head_dim=64, d_ff=1536, linear_heads=8, linear_head_dim=64,
    ),
}  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [tokens, dim], normalized in fp32, scaled in x's dtype (also run compiled)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [tokens, 1, dim] for :func:`apply_rope` (computed in fp32, then cast)."""
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (steps / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [tokens, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Llama's rotate-half rotary embedding. x: [tokens, heads, head_dim]."""
    cos, sin = tables
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, Llama's rotate-half convention. x: [tokens, heads, head_dim]."""
    return apply_rope(x, rope_tables(positions, x.shape[-1], theta, x.dtype))


class Attention(nn.Module):
    """Grouped-query attention with RoPE (kind ``A``; Llama's ``self_attn``)."""

    attr = "self_attn"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, q, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.d_model, bias=False)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor, tables=None):
        # h: [n, d_model] -> q: [n, H, hd], k/v: [n, KV, hd]; tables: rope_tables(positions)
        cfg, n = self.cfg, h.shape[0]
        if tables is None:
            tables = rope_tables(positions, cfg.head_dim, cfg.rope_theta, h.dtype)
        q = self.q_proj(h).view(n, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(h).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(h).view(n, cfg.num_kv_heads, cfg.head_dim)
        return apply_rope(q, tables), apply_rope(k, tables), v

    def attend(self, q, k, v, q_positions: torch.Tensor) -> torch.Tensor:
        """q: [n, H, hd] at q_positions; k/v: [m, KV, hd] at positions 0..m-1."""
        out = masked_attention(q, k, v, q_positions, self.cfg.head_dim**-0.5)
        return self.o_proj(out.reshape(q.shape[0], -1))

    def full(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[0], device=h.device)
        q, k, v = self.qkv(h, positions)
        return self.attend(q, k, v, positions)

    # -- the paged seam -----------------------------------------------------------

    paged = True

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.cfg.num_kv_heads, self.cfg.head_dim),
                "v": (self.cfg.num_kv_heads, self.cfg.head_dim)}  # fmt: skip

    def wave_rope(self, batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The wave's rotary tables, built once per wave and shared by the stage's layers."""
        cfg = self.cfg
        key = ("rope", cfg.head_dim, cfg.rope_theta, dtype)
        if key not in batch.kernel_state:
            batch.kernel_state[key] = rope_tables(batch.positions, cfg.head_dim,
                                                  cfg.rope_theta, dtype)  # fmt: skip
        return batch.kernel_state[key]

    def paged_attend(self, q, k, v, batch, pools, attention, queries=None) -> torch.Tensor:
        """Store the wave's k/v in the pools, attend: [T, H * hd] (or [R, H * hd], the rows
        of ``queries``), before ``o_proj``."""
        write_paged(pools["k"], batch, k)
        write_paged(pools["v"], batch, v)
        batch, q = to_queries(batch, queries, q)
        out = attention(q, pools["k"], pools["v"], batch, self.cfg.head_dim**-0.5)
        return out.flatten(1)

    def paged_forward(self, h: torch.Tensor, batch, pools, attention,
                      queries=None) -> torch.Tensor:  # fmt: skip
        # h: [T, d_model], the wave's new tokens; their prefixes are in the pools.
        q, k, v = self.qkv(h, batch.positions, self.wave_rope(batch, h.dtype))  # q: [T, H, hd]
        return self.o_proj(self.paged_attend(q, k, v, batch, pools, attention, queries))


class GatedLinearAttention(nn.Module):
    """Gated linear attention (kind ``L``): per head, a head_dim x head_dim state

        S_t = exp(a_t) S_{t-1} + k_t^T v_t,   o_t = (q_t S_t) * silu(g_t)

    with a data-dependent scalar decay a_t = -softplus(w_a x_t) per head. Prefill uses
    the chunked-parallel form; :meth:`full` is the token-by-token recurrence.
    """

    attr = "linear_attn"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.linear_heads * cfg.linear_head_dim
        self.q_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.a_proj = nn.Linear(cfg.d_model, cfg.linear_heads, bias=True)
        self.g_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)

    def state_shape(self) -> tuple[int, int, int]:
        d = self.cfg.linear_head_dim
        return (self.cfg.linear_heads, d, d)

    def project(self, h: torch.Tensor):
        # h: [n, d_model] -> q, k, v: [n, Hl, dl]; a: [n, Hl] (log decay ≤ 0)
        cfg, n = self.cfg, h.shape[0]
        shape = (n, cfg.linear_heads, cfg.linear_head_dim)
        q = self.q_proj(h).view(shape) * cfg.linear_head_dim**-0.5
        k = F.normalize(self.k_proj(h).view(shape), dim=-1)
        v = self.v_proj(h).view(shape)
        a = -F.softplus(self.a_proj(h))
        return q, k, v, a

    def finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        # o: [n, Hl, dl]
        return self.o_proj(o.reshape(o.shape[0], -1) * F.silu(self.g_proj(h)))

    @staticmethod
    def scan(q, k, v, a, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked-parallel form over one piece. q,k,v: [m, Hl, dl]; a: [m, Hl];
        state: [Hl, dl, dl]. Returns (o: [m, Hl, dl], state after the piece)."""
        b = a.cumsum(0)  # [m, Hl]
        m = q.shape[0]
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        decay = (b[:, None, :] - b[None, :, :]).masked_fill(~causal[:, :, None], -math.inf).exp()
        scores = torch.einsum("thd,shd->hts", q, k) * decay.permute(2, 0, 1)  # [Hl, m, m]
        o = torch.einsum("hts,shd->thd", scores, v)
        o = o + torch.einsum("thd,hde->the", q, state) * b.exp()[:, :, None]
        tail = (b[-1][None, :] - b).exp()  # [m, Hl]
        state = state * b[-1].exp()[:, None, None] + torch.einsum("sh,shd,she->hde", tail, k, v)
        return o, state

    # -- the recurrent seam ------------------------------------------------------

    paged = False

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"state": self.state_shape()}

    def zero_state(self) -> torch.Tensor:
        """The state before a prompt: float32 whatever the weights' dtype (the sums over
        the whole prompt accumulate in it), on the weights' device."""
        return torch.zeros(self.state_shape(), dtype=torch.float32,
                           device=self.o_proj.weight.device)  # fmt: skip

    def chunk(self, h: torch.Tensor, state: dict | None, cuts: tuple[int, ...] = ()):
        """h: [n, d_model]; the chunked-parallel form over the pieces between cuts, in
        float32 (the state stays float32; the output is in h's dtype)."""
        s = self.zero_state() if state is None else state["state"].float()
        q, k, v, a = (t.float() for t in self.project(h))
        bounds = sorted({0, h.shape[0], *[c for c in cuts if 0 < c < h.shape[0]]})
        outs, at_cut = [], {0: s}
        for lo, hi in itertools.pairwise(bounds):  # one piece per snapshot cut
            o, s = self.scan(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], s)
            outs.append(o)
            at_cut[hi] = s
        return (self.finish(h, torch.cat(outs).to(h.dtype)), {"state": s},
                [{"state": at_cut[c]} for c in cuts])  # fmt: skip

    def full(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v, a = (t.float() for t in self.project(h))
        state = self.zero_state()
        outs = []
        for t in range(h.shape[0]):
            state = state * a[t].exp()[:, None, None] + torch.einsum("hd,he->hde", k[t], v[t])
            outs.append(torch.einsum("hd,hde->he", q[t], state))
        return self.finish(h, torch.stack(outs).to(h.dtype))


MIXERS: dict[str, type[nn.Module]] = {"A": Attention, "L": GatedLinearAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        mixer = MIXERS[kind](cfg)
        setattr(self, mixer.attr, mixer)
        self.mixer_name = mixer.attr
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def ffn(self) -> nn.Module:
        return self.mlp


class StageModules(StageBase):
    """The modules one stage of a built-in model holds (see ``StageBase``)."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__(cfg, layers, first, last, lambda i: DecoderLayer(cfg, cfg.kind(i)),
                         lambda: RMSNorm(cfg.d_model, cfg.norm_eps))  # fmt: skip


def random_weights(cfg: ModelConfig | FamilyConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full model's weights from a seed, the same on every rank whatever the split."""
    if isinstance(cfg, FamilyConfig):
        return family_random_weights(cfg, seed)
    generator = torch.Generator().manual_seed(seed)
    full = StageModules(cfg, range(cfg.num_layers), first=True, last=True)
    state = {}
    for name, param in full.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        elif name.endswith("a_proj.bias"):
            state[name] = torch.full(param.shape, 1.0) + 0.5 * torch.randn(
                param.shape, generator=generator
            )
        else:
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            state[name] = std * torch.randn(param.shape, generator=generator)
    return state


def build_stage(cfg: ModelConfig | FamilyConfig, layers: range, first: bool, last: bool,
                weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> StageModules:  # fmt: skip
    """The stage's modules with their weights, on ``device`` in ``dtype``."""
    if isinstance(cfg, FamilyConfig):
        return build_family_stage(cfg, layers, first, last, weights, device, dtype)
    modules = StageModules(cfg, layers, first, last)
    wanted = modules.state_dict().keys()
    missing = [k for k in wanted if k not in weights]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    modules.load_state_dict({k: weights[k] for k in wanted})
    return modules.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def reference_logits(
    cfg: ModelConfig | FamilyConfig, weights: dict[str, torch.Tensor], tokens
) -> torch.Tensor:
    """Plain single-process forward of the whole model: logits at the last position."""
    if isinstance(cfg, FamilyConfig):
        return family_reference_logits(cfg, weights, tokens)
    model = build_stage(cfg, range(cfg.num_layers), True, True, weights)
    x = model.model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))  # [n, d_model]
    for i in model.layer_ids:
        layer = model.layer(i)
        x = x + layer.mixer.full(layer.input_layernorm(x))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.head(x[-1:])[0]
