"""Paged layer kinds: grouped-query attention (Llama's; with q/k norms, partial RoPE and
an optional output gate, Qwen3-Next's and MiniMax-M2's) and multi-head latent attention
(Kimi Linear's MLA).

Each declares the per-token entries it keeps in the paged pool (``cache_layout``): keys
and values ``[KV, hd]`` for GQA, the compressed latent ``[1, rank + rope_dim]`` for MLA.
``paged_forward`` runs a whole wave over the pool (``wavepp.model.attention``); MLA
attends in the absorbed form, straight over the latents. ``full`` is the reference:
``project`` then ``attend`` over the prompt's own entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model import cpu_kernel
from wavepp.model.attention import paged_attention, to_queries, write_paged
from wavepp.model.common import RMSNorm, RowFusion, apply_rope, rope_tables
from wavepp.model.tp import NO_TP, TPGroup


def masked_attention(q, k, v, q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference attention of the ``full`` forwards: q: [n, H, d] at q_positions;
    k: [m, KV, d], v: [m, KV, dv] at 0..m-1 -> [n, H, dv] (causal; a dense mask when
    the queries follow a prefix). 4-D inputs take PyTorch's fused CPU kernel."""
    n, m = q.shape[0], k.shape[0]
    if n == m:
        mask, causal = None, True
    else:
        mask = torch.arange(m, device=q.device)[None, :] <= q_positions[:, None]  # [n, m]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # [1, H, n, dv]; fmt: skip
    return out[0].transpose(0, 1)


class GQAttention(nn.Module):
    """Grouped-query attention with rotary embedding on the leading ``rotary_dim`` head
    dims. ``qk_norm``: None (Llama), "head" (per-head, 1+w: Qwen3-Next) or "full" (over
    all heads: MiniMax-M2); ``gated``: q_proj also yields a sigmoid output gate
    (Qwen3-Next).

    ``tp``: the stage's tensor-parallel ranks (``wavepp.model.tp``). Head counts are the
    model's; this rank holds ``num_heads / tp.size`` heads and ``num_kv_heads / tp.size``
    KV heads, and ``o_proj`` returns its partial sum (the executor reduces it). The
    "full" norms span every rank's heads: their sums of squares are all-reduced."""

    paged = True

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        rope_theta: float,
        eps: float,
        qk_norm: str | None = None,
        gated: bool = False,
        tp: TPGroup = NO_TP,
    ) -> None:
        super().__init__()
        self.tp = tp
        num_heads, num_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim, self.rope_theta, self.gated = rotary_dim, rope_theta, gated
        self.qk_norm = qk_norm
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(d_model, q_out, bias=False)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.fused_qkv = RowFusion([self.q_proj, self.k_proj, self.v_proj])
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, eps, offset=True)
            self.k_norm = RMSNorm(head_dim, eps, offset=True)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(num_heads * head_dim, eps)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, eps)

    def prepare(self) -> None:
        """q, k and v as one matrix product, once the checkpoint is loaded (``build_stage``)."""
        self.fused_qkv.fuse()

    @property
    def llama_shaped(self) -> bool:
        """Llama's attention: no q/k norms, no output gate, RoPE on every head dim."""
        return self.qk_norm is None and not self.gated and self.rotary_dim == self.head_dim

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_tables(positions, self.rotary_dim, self.rope_theta, dtype)

    def wave_rope(self, batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The wave's rotary tables, built once per wave and shared by the stage's layers."""
        key = ("rope", self.rotary_dim, self.rope_theta, dtype)
        if key not in batch.kernel_state:
            batch.kernel_state[key] = self.rope(batch.positions, dtype)
        return batch.kernel_state[key]

    def qkv(self, h: torch.Tensor, tables):
        """h: [n, d_model] -> q: [n, H, hd], gate: [n, H*hd] | None, k, v: [n, KV, hd];
        ``tables``: :meth:`rope` of the tokens' positions."""
        n, hd = h.shape[0], self.head_dim
        gate = None
        # one product for q (and the gate), k and v: [n, q_out + 2 KV hd], split in views
        q, k, v = F.linear(h, self.fused_qkv.weight()).split(self.fused_qkv.sizes, dim=-1)
        v = v.view(n, self.num_kv_heads, hd)
        if self.gated:
            q, gate = q.reshape(n, self.num_heads, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(n, -1)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(n, self.num_heads, hd))
            k = self.k_norm(k.view(n, self.num_kv_heads, hd))
        elif self.qk_norm == "full":
            q, k = self.full_norms(q, k)
            q, k = q.view(n, self.num_heads, hd), k.view(n, self.num_kv_heads, hd)
        else:
            q = q.view(n, self.num_heads, hd)
            k = k.view(n, self.num_kv_heads, hd)
        if cpu_kernel.fused_fits(q, k, *tables) and q.stride(-1) == k.stride(-1) == 1:
            # in place: q and k are this call's own (views of the product, or normed)
            return cpu_kernel.rope_(q, *tables), gate, cpu_kernel.rope_(k, *tables), v
        return apply_rope(q, tables), gate, apply_rope(k, tables), v

    def full_norms(self, q: torch.Tensor, k: torch.Tensor):
        """MiniMax-M2's q and k norms over all heads. q: [n, H*hd], k: [n, KV*hd], this
        rank's heads; over several ranks, one all-reduce sums both sums of squares."""
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        q32, k32 = q.float(), k.float()
        squares = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)  # [n, 2]
        squares = self.tp.all_reduce(squares)
        normed = []
        for x, x32, norm, sq in ((q, q32, self.q_norm, squares[:, :1]),
                                 (k, k32, self.k_norm, squares[:, 1:])):  # fmt: skip
            mean = sq / (x.shape[-1] * self.tp.size)
            normed.append(norm.weight * (x32 * torch.rsqrt(mean + norm.eps)).to(x.dtype))
        return normed[0], normed[1]

    def project(self, h: torch.Tensor, positions: torch.Tensor):
        # h: [n, d_model] -> (q: [n, H, hd], gate: [n, H*hd] | None), entries: [n, 2, KV, hd]
        q, gate, k, v = self.qkv(h, self.rope(positions, h.dtype))
        return (q, gate), torch.stack([k, v], dim=1)

    def attend(self, query, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # entries: [m, 2, KV, hd] for tokens 0..m-1
        q, gate = query
        out = masked_attention(q, entries[:, 0], entries[:, 1], positions, self.head_dim**-0.5)
        return self.o_proj(self.apply_gate(out.reshape(q.shape[0], -1), gate))

    def apply_gate(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return out if gate is None else out * torch.sigmoid(gate)

    def full(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[0], device=h.device)
        query, entries = self.project(h, positions)
        return self.attend(query, entries, positions)

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def paged_attend(self, q, gate, k, v, batch, pools, queries=None) -> torch.Tensor:
        """Store the wave's k/v in the pools, attend: [T, H * hd] (or [R, H * hd], the rows
        of ``queries``), gated, before ``o_proj``."""
        write_paged(pools["k"], batch, k)
        write_paged(pools["v"], batch, v)
        batch, q, gate = to_queries(batch, queries, q, gate)
        out = paged_attention(q, pools["k"], pools["v"], batch, self.head_dim**-0.5)  # [T, H, hd]
        return self.apply_gate(out.flatten(1), gate)

    def paged_forward(self, h: torch.Tensor, batch, pools, queries=None) -> torch.Tensor:
        # h: [T, d_model], the wave's new tokens; their prefixes are in the pools;
        # with queries, the output is for their rows only ([R, d_model])
        q, gate, k, v = self.qkv(h, self.wave_rope(batch, h.dtype))
        return self.o_proj(self.paged_attend(q, gate, k, v, batch, pools, queries))


class LatentAttention(nn.Module):
    """MLA as in Kimi Linear (no positional encoding): the pool keeps the normalized
    latent and the shared key part, ``[kv_lora_rank + qk_rope_head_dim]`` per token;
    ``kv_b_proj`` expands them to per-head keys and values when attending.

    ``tp``: this rank holds ``num_heads / tp.size`` heads (their q and ``kv_b_proj``
    rows, their ``o_proj`` columns: a partial sum, reduced by the executor) and the whole
    latent path, so the whole latent pool: every head reads all of it."""

    paged = True

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        eps: float,
        tp: TPGroup = NO_TP,
    ) -> None:
        super().__init__()
        num_heads //= tp.size
        self.num_heads, self.rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        qk = nope_dim + rope_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(d_model, kv_lora_rank + rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, d_model, bias=False)
        self.scale = qk**-0.5

    def project(self, h: torch.Tensor, positions: torch.Tensor):
        # h: [n, d_model] -> q: [n, H, nope + rope], entries: [n, rank + rope]
        n = h.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if self.q_lora else self.q_proj(h)
        latent, k_shared = self.kv_a_proj_with_mqa(h).split([self.rank, self.rope_dim], dim=-1)
        entries = torch.cat([self.kv_a_layernorm(latent), k_shared], dim=-1)
        return q.view(n, self.num_heads, -1), entries

    def attend(self, q, entries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # entries: [m, rank + rope] for tokens 0..m-1
        m, heads = entries.shape[0], self.num_heads
        latent, k_shared = entries.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(m, heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared[:, None, :].expand(m, heads, self.rope_dim)], dim=-1)
        out = masked_attention(q, k, v, positions, self.scale)  # [n, H, v_dim]
        return self.o_proj(out.reshape(q.shape[0], -1))

    def full(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[0], device=h.device)
        q, entries = self.project(h, positions)
        return self.attend(q, entries, positions)

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        return {"latent": (1, self.rank + self.rope_dim)}

    def paged_forward(self, h: torch.Tensor, batch, pools, queries=None) -> torch.Tensor:
        """Absorbed form: queries move into the latent space, so attention reads the
        latent pool as keys ([latent, k_shared]) and its leading ``rank`` dims as values.
        With ``queries``, the output is for their rows only ([R, d_model])."""
        q, entries = self.project(h, batch.positions)  # q: [T, H, nope + rope]
        pool = pools["latent"]  # [rows, 1, rank + rope]
        write_paged(pool, batch, entries[:, None, :])
        batch, q = to_queries(batch, queries, q)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, r], [H, v, r]
        q_nope, q_shared = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_k)  # [T, H, rank]
        query = torch.cat([q_latent, q_shared], dim=-1)  # [T, H, rank + rope]
        # out: [T, H, rank]
        out = paged_attention(query, pool, pool[..., : self.rank], batch, self.scale)
        out = torch.einsum("thr,hvr->thv", out, w_v)  # [T, H, v]
        return self.o_proj(out.flatten(1))
