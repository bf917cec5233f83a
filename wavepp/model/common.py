"""Small pieces the families share: RMS norms, partial RoPE, SwiGLU, short convolution,
and the container of one stage's modules (also the built-in models')."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``offset`` the scale is ``1 + weight`` (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``weight * x / rms(x) * act(gate)`` over the last dim: sigmoid (KDA), SiLU (GDN)."""

    def __init__(self, dim: int, eps: float, act: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.act = torch.sigmoid if act == "sigmoid" else F.silu

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., dim]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * self.act(gate.float())).to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` under the checkpoint's own names."""

    def __init__(self, d_model: int, d_ff: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(d_model, d_ff, bias=False))
        setattr(self, names[1], nn.Linear(d_model, d_ff, bias=False))
        setattr(self, names[2], nn.Linear(d_ff, d_model, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


def rope_partial(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int):
    """Rotate-half RoPE on the first ``rotary_dim`` dims. x: [n, heads, head_dim]."""
    if rotary_dim == 0:
        return x
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=x.device) / rotary_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, rotary_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def short_conv(x: torch.Tensor, prior: torch.Tensor, weight: torch.Tensor):
    """Causal depthwise convolution + SiLU with carried state.

    x: [n, C] new inputs; prior: [K-1, C] the inputs just before them (zeros at t=0);
    weight: [C, K]. Returns (y: [n, C], window: [K-1+n, C] = prior then x, for states).
    """
    window = torch.cat([prior, x], dim=0)  # [K-1+n, C]
    y = F.conv1d(window.T[None], weight[:, None, :], groups=weight.shape[0])[0].T  # [n, C]
    return F.silu(y), window


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class StageBase(nn.Module):
    """The modules one stage holds: its layers, plus the embeddings (first stage; also the
    last with tied embeddings) and the final norm and head (last stage).

    Parameter names match the full checkpoint's (``model.layers.{i}...``), so its tensors
    load by name on every stage. ``make_layer(i)`` builds layer ``i``; ``final_norm()``
    the last stage's norm.
    """

    def __init__(self, cfg, layers: range, first: bool, last: bool,
                 make_layer: Callable[[int], nn.Module],
                 final_norm: Callable[[], nn.Module]) -> None:  # fmt: skip
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.layer_ids = list(layers)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): make_layer(i) for i in layers})
        if first or (last and cfg.tie_embeddings):
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if last:
            self.model.norm = final_norm()
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.first, self.last = first, last

    def layer(self, i: int) -> nn.Module:
        return self.model.layers[str(i)]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        # h: [n, d_model] -> logits [n, vocab]
        h = self.model.norm(h)
        if self.cfg.tie_embeddings:
            return h @ self.model.embed_tokens.weight.T
        return self.lm_head(h)
