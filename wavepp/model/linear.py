"""Recurrent layer kinds: Kimi Delta Attention (KDA), Qwen3-Next's Gated DeltaNet, and
WavePP's gated linear attention (the built-in hybrids' ``L`` layers).

KDA and Gated DeltaNet keep, per request, a delta-rule state ``[heads, dk, dv]`` and the
short convolution's state ``[K-1, channels]`` (the last K-1 inputs of the convolution);
gated linear attention one state ``[heads, d, d]``. Their parameters carry the names
``save_pretrained`` writes (``linear_attn`` for gated linear attention). ``chunk`` is the
prefill path (chunk-parallel); ``full`` is the token-by-token reference. States are
float32 on the weights' device whatever the weights' dtype: the sums over the whole
prompt accumulate in them.

Each takes the stage's tensor-parallel ranks (``tp``, ``wavepp.model.tp``) and holds
``1 / tp.size`` of the model's heads, with their states: its output projection returns
a partial sum, which the executor reduces.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model.common import GatedRMSNorm, l2norm, short_conv
from wavepp.model.delta import chunk_delta, recurrent_delta
from wavepp.model.tp import NO_TP, TPGroup

State = dict[str, torch.Tensor]  # {"delta": [H, dk, dv], "conv": [K-1, channels]}


class _Recurrent(nn.Module):
    paged = False
    num_heads: int
    dk: int
    dv: int
    conv_kernel: int
    conv_channels: int

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "delta": (self.num_heads, self.dk, self.dv),
            "conv": (self.conv_kernel - 1, self.conv_channels),
        }

    def zero_state(self) -> State:
        """The state before a prompt: float32, on the weights' device."""
        device = next(self.parameters()).device
        return {
            name: torch.zeros(shape, dtype=torch.float32, device=device)
            for name, shape in self.state_shapes().items()
        }

    def _inputs(self, h):  # -> pre-conv channels [n, C], extras for _mix
        raise NotImplementedError

    def _mix(self, conv_out, extras):  # -> q, k, v, g, beta
        raise NotImplementedError

    def _finish(self, o, extras) -> torch.Tensor:
        raise NotImplementedError

    def chunk(self, h: torch.Tensor, state: State | None, cuts: tuple[int, ...] = ()):
        """h: [n, d_model]; state before h (None: zeros). Returns (out: [n, d_model],
        state after h, [state after h[:c] for c in cuts])."""
        state = state if state is not None else self.zero_state()
        x, extras = self._inputs(h)
        y, window = short_conv(x, state["conv"].to(x.dtype), self.conv_weight())
        q, k, v, g, beta = self._mix(y, extras)
        o, final, saved = chunk_delta(q, k, v, g, beta, state["delta"], cuts)
        width = self.conv_kernel - 1
        n = h.shape[0]
        after = {"delta": final, "conv": window[n : n + width].to(torch.float32, copy=True)}
        at_cuts = [
            {"delta": s, "conv": window[c : c + width].to(torch.float32, copy=True)}
            for c, s in zip(cuts, saved, strict=True)
        ]
        return self._finish(o, extras), after, at_cuts

    def full(self, h: torch.Tensor) -> torch.Tensor:
        """The reference: plain convolution and the token-by-token recurrence."""
        state = self.zero_state()
        x, extras = self._inputs(h)
        y, _ = short_conv(x, state["conv"].to(x.dtype), self.conv_weight())
        q, k, v, g, beta = self._mix(y, extras)
        o, _ = recurrent_delta(q, k, v, g, beta, state["delta"])
        return self._finish(o, extras)


class GatedLinearAttention(nn.Module):
    """Gated linear attention: per head, a head_dim x head_dim state

        S_t = exp(a_t) S_{t-1} + k_t^T v_t,   o_t = (q_t S_t) * silu(g_t)

    with a data-dependent scalar decay a_t = -softplus(w_a x_t) per head. Prefill uses
    the chunked-parallel form; :meth:`full` is the token-by-token recurrence.
    """

    paged = False

    def __init__(self, d_model: int, num_heads: int, head_dim: int, tp: TPGroup = NO_TP) -> None:
        super().__init__()
        num_heads //= tp.size
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.a_proj = nn.Linear(d_model, num_heads, bias=True)
        self.g_proj = nn.Linear(d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, d_model, bias=False)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"state": (self.num_heads, self.head_dim, self.head_dim)}

    def zero_state(self) -> dict[str, torch.Tensor]:
        """The state before a prompt: float32, on the weights' device."""
        device = self.o_proj.weight.device
        return {"state": torch.zeros(self.state_shapes()["state"], dtype=torch.float32,
                                     device=device)}  # fmt: skip

    def _project(self, h: torch.Tensor):
        # h: [n, d_model] -> q, k, v: [n, H, d]; a: [n, H] (log decay <= 0), all float32
        shape = (h.shape[0], self.num_heads, self.head_dim)
        q = self.q_proj(h).view(shape) * self.head_dim**-0.5
        k = F.normalize(self.k_proj(h).view(shape), dim=-1)
        v = self.v_proj(h).view(shape)
        a = -F.softplus(self.a_proj(h))
        return q.float(), k.float(), v.float(), a.float()

    def _finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        # o: [n, H, d] float32 -> [n, d_model] in h's dtype
        o = o.to(h.dtype).reshape(o.shape[0], -1)
        return self.o_proj(o * F.silu(self.g_proj(h)))

    @staticmethod
    def _scan(q, k, v, a, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked-parallel form over one piece. q,k,v: [m, H, d]; a: [m, H];
        state: [H, d, d]. Returns (o: [m, H, d], state after the piece)."""
        b = a.cumsum(0)  # [m, H]
        m = q.shape[0]
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        decay = (b[:, None, :] - b[None, :, :]).masked_fill(~causal[:, :, None], -math.inf).exp()
        scores = torch.einsum("thd,shd->hts", q, k) * decay.permute(2, 0, 1)  # [H, m, m]
        o = torch.einsum("hts,shd->thd", scores, v)
        o = o + torch.einsum("thd,hde->the", q, state) * b.exp()[:, :, None]
        tail = (b[-1][None, :] - b).exp()  # [m, H]
        state = state * b[-1].exp()[:, None, None] + torch.einsum("sh,shd,she->hde", tail, k, v)
        return o, state

    def chunk(self, h: torch.Tensor, state: dict | None, cuts: tuple[int, ...] = ()):
        """h: [n, d_model]; the chunked-parallel form over the pieces between cuts.
        Returns (out: [n, d_model], state after h, [state after h[:c] for c in cuts])."""
        s = (self.zero_state() if state is None else state)["state"].float()
        q, k, v, a = self._project(h)
        bounds = sorted({0, h.shape[0], *[c for c in cuts if 0 < c < h.shape[0]]})
        outs, at_cut = [], {0: s}
        for lo, hi in itertools.pairwise(bounds):  # one piece per snapshot cut
            o, s = self._scan(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], s)
            outs.append(o)
            at_cut[hi] = s
        return (self._finish(h, torch.cat(outs)), {"state": s},
                [{"state": at_cut[c]} for c in cuts])  # fmt: skip

    def full(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v, a = self._project(h)
        state = self.zero_state()["state"]
        outs = []
        for t in range(h.shape[0]):
            state = state * a[t].exp()[:, None, None] + torch.einsum("hd,he->hde", k[t], v[t])
            outs.append(torch.einsum("hd,hde->he", q[t], state))
        return self._finish(h, torch.stack(outs))


class KimiDeltaAttention(_Recurrent):
    """KDA: per-channel forget gate, sigmoid-gated output norm (Kimi Linear ``self_attn``)."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, conv_kernel: int,
                 eps: float, tp: TPGroup = NO_TP) -> None:  # fmt: skip
        super().__init__()
        num_heads //= tp.size
        self.num_heads, self.dk, self.dv = num_heads, head_dim, head_dim
        inner = num_heads * head_dim
        self.conv_kernel, self.conv_channels = conv_kernel, 3 * inner
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.q_conv1d = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=False)
        self.k_conv1d = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=False)
        self.v_conv1d = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=False)
        self.f_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(inner))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.b_proj = nn.Linear(d_model, num_heads, bias=False)
        self.g_a_proj = nn.Linear(d_model, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, inner, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps, "sigmoid")
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self._fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self) -> None:
        """Fuse q/k/v projections and convolutions once the checkpoint is loaded."""
        self._fused = (
            torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
            torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]),
        )

    def conv_weight(self) -> torch.Tensor:  # [3 * inner, K]
        if self._fused is None:
            self.prepare()
        return self._fused[1]

    def _inputs(self, h):
        # h: [n, d_model] -> x: [n, 3 * inner] (q | k | v before the convolution)
        if self._fused is None:
            self.prepare()
        return F.linear(h, self._fused[0]), h

    def _mix(self, y, h):
        n, heads, d = h.shape[0], self.num_heads, self.dk
        q, k, v = y.view(n, 3, heads, d).unbind(1)
        q = l2norm(q.float()) * d**-0.5
        k = l2norm(k.float())
        gate = self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp().view(heads, 1) * F.softplus(gate.view(n, heads, d))
        beta = torch.sigmoid(self.b_proj(h).float())
        return q, k, v.float(), g, beta

    def _finish(self, o, h):
        # o: [n, H, d]
        n = h.shape[0]
        gate = self.g_b_proj(self.g_a_proj(h)).view(n, self.num_heads, self.dv)
        return self.o_proj(self.o_norm(o.to(h.dtype), gate).reshape(n, -1))


class GatedDeltaNet(_Recurrent):
    """Gated DeltaNet: scalar decay per head, SiLU-gated output norm (Qwen3-Next
    ``linear_attn``). Key heads are shared by ``num_v_heads / num_k_heads`` value heads."""

    def __init__(
        self,
        d_model: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        tp: TPGroup = NO_TP,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not group over {num_k_heads} key heads")
        # a rank holds whole key heads with their value heads (the checkpoint groups them)
        num_k_heads, num_v_heads = num_k_heads // tp.size, num_v_heads // tp.size
        self.num_k_heads, self.num_heads = num_k_heads, num_v_heads
        self.dk, self.dv = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_kernel, self.conv_channels = conv_kernel, 2 * self.key_dim + self.value_dim
        channels = self.conv_channels
        self.conv1d = nn.Conv1d(channels, channels, conv_kernel, groups=channels, bias=False)
        self.in_proj_qkvz = nn.Linear(d_model, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d_model, 2 * num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps, "silu")
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=False)
        self._order: torch.Tensor | None = None
        self._fused: torch.Tensor | None = None

    def conv_weight(self) -> torch.Tensor:  # [channels, K]
        return self.conv1d.weight[:, 0]

    def prepare(self) -> None:
        """One projection with rows q | k | v | z | b | a, once the checkpoint is loaded."""
        rows = torch.cat([self.in_proj_qkvz.weight, self.in_proj_ba.weight])
        self._fused = rows[self._row_order().to(rows.device)]

    def _row_order(self) -> torch.Tensor:
        """Rows of [in_proj_qkvz; in_proj_ba] in the order q | k | v | z | b | a (the
        checkpoint interleaves them per key head)."""
        if self._order is None:
            r, hk, hv = self.num_heads // self.num_k_heads, self.dk, self.dv
            group = 2 * hk + 2 * r * hv
            parts: list[list[torch.Tensor]] = [[], [], [], []]
            for h in range(self.num_k_heads):
                base = h * group
                for i, (off, size) in enumerate(
                    [(0, hk), (hk, hk), (2 * hk, r * hv), (2 * hk + r * hv, r * hv)]
                ):
                    parts[i].append(torch.arange(base + off, base + off + size))
            rows = [torch.cat(p) for p in parts]
            total = self.num_k_heads * group
            ba_b = [total + h * 2 * r + torch.arange(r) for h in range(self.num_k_heads)]
            ba_a = [total + h * 2 * r + r + torch.arange(r) for h in range(self.num_k_heads)]
            self._order = torch.cat([*rows, *ba_b, *ba_a])
        return self._order

    def _inputs(self, h):
        # h: [n, d_model] -> x: [n, 2 key_dim + value_dim] (q | k | v), extras (z, b, a)
        if self._fused is None:
            self.prepare()
        out = F.linear(h, self._fused)
        c, vd, nv = self.conv_channels, self.value_dim, self.num_heads
        z = out[:, c : c + vd]
        b, a = out[:, c + vd : c + vd + nv], out[:, c + vd + nv :]
        return out[:, :c], (h, z, b, a)

    def _mix(self, y, extras):
        h, _, b, a = extras
        n, r = h.shape[0], self.num_heads // self.num_k_heads
        q = y[:, : self.key_dim].reshape(n, self.num_k_heads, self.dk).float()
        k = y[:, self.key_dim : 2 * self.key_dim].reshape(n, self.num_k_heads, self.dk).float()
        v = y[:, 2 * self.key_dim :].reshape(n, self.num_heads, self.dv).float()
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        q = l2norm(q) * self.dk**-0.5
        k = l2norm(k)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [n, nv]
        return q, k, v, g, torch.sigmoid(b.float())

    def _finish(self, o, extras):
        h, z, _, _ = extras
        n = h.shape[0]
        normed = self.norm(o.to(h.dtype), z.reshape(n, self.num_heads, self.dv))
        return self.out_proj(normed.reshape(n, -1))
