"""Pieces every model shares: RMS norms, rotary embedding (whole or partial), SwiGLU,
the short convolution of the recurrent layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], normalized in fp32, scaled in x's dtype (also run compiled)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``offset`` the scale is ``1 + weight`` (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        if not self.offset:
            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


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


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos, sin: [tokens, 1, rotary_dim] for :func:`apply_rope` (fp32, then cast)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (steps / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [tokens, rotary_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half rotary embedding of the leading ``rotary_dim`` dims (the tables' width)
    of x: [tokens, heads, head_dim]; the rest pass as they are (partial RoPE)."""
    cos, sin = tables
    width = cos.shape[-1]
    if width == 0:
        return x
    rot, half = x[..., :width], width // 2
    rotated = rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * sin
    return rotated if width == x.shape[-1] else torch.cat([rotated, x[..., width:]], dim=-1)


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
