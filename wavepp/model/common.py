"""Pieces every model shares: RMS norms, rotary embedding (whole or partial), SwiGLU,
the short convolution of the recurrent layers; linears that read one input run as one
matrix product (:class:`RowFusion`).

On the CPU in fp32 or bf16, RMSNorm, the rotary embedding of the attention layers and
SwiGLU's ``silu(gate) * up`` run as WavePP's fused ops (``wavepp.model.cpu_kernel``),
one pass each over their rows; the PyTorch forms here are the reference they match, and
what runs elsewhere (and under ``torch.compile``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from wavepp.model import cpu_kernel


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
        if cpu_kernel.fused_fits(x, self.weight):
            return cpu_kernel.rms_norm(x, self.weight, self.eps, self.offset)
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


class RowFusion:
    """Bias-free linears that read the same input, run as one matrix product: their
    weights become row blocks of one tensor, each linear's ``weight`` a view of its
    block, so nothing is held twice and the checkpoint's names and shapes stay (loading
    a state dict writes through the views). Fused once the weights are loaded
    (``prepare``), and again whenever a weight has been replaced since (``.to()`` to
    another dtype or device)."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.linears = tuple(linears)
        self.sizes = [m.out_features for m in self.linears]
        self._weight: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        """[sum of out_features, in_features]: the linears' rows, in order."""
        if not self._current():
            self.fuse()
        return self._weight

    def fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([m.weight for m in self.linears])
            at = 0
            for m, n in zip(self.linears, self.sizes, strict=True):
                m.weight = nn.Parameter(fused[at : at + n], requires_grad=m.weight.requires_grad)
                at += n
        self._weight = fused

    def _current(self) -> bool:
        fused = self._weight
        if fused is None:
            return False
        row, at = fused.stride(0) * fused.element_size(), fused.data_ptr()
        for m, n in zip(self.linears, self.sizes, strict=True):
            if m.weight.data_ptr() != at or m.weight.dtype != fused.dtype:
                return False
            at += n * row
        return True


class _Scratch(threading.local):
    """One reused buffer per thread for SwiGLU's ``[rows, 2 d_ff]`` product on the CPU.

    At a wave of 2,048 tokens of a 0.5B model that product is 80 MB in fp32: above
    glibc's largest mmap threshold (32 MiB), so a fresh one is a fresh mapping whose
    19,500 pages fault in (and are zeroed) on every call. Kept, it costs nothing again:
    the deep model's MLP ran at 88 GFLOP per CPU-second with a fresh product, 104 with
    this buffer (bf16: 334 and 405). It grows to the largest product seen (a wave, or a
    bf16 chunk: :data:`MLP_ROWS`) and stays, one per thread that ran a wave (the
    executor's compute thread)."""

    buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] tensor of ``like``'s dtype over this thread's buffer (its
        contents undefined; valid until the next ``take`` on this thread)."""
        n, buffer = rows * cols, self.buffer
        if buffer is None or buffer.numel() < n or buffer.dtype != like.dtype:
            buffer = self.buffer = torch.empty(n, dtype=like.dtype)
        return buffer[:n].view(rows, cols)


_SCRATCH = _Scratch()


# SwiGLU's rows a CPU product takes at a time, by dtype (others: the whole wave). The
# deep model's MLP (d 896, d_ff 4,864; this module, two cores) ran in bf16 at 0.80-0.86
# TFLOP/s a 1,024-row wave whole against 1.12-1.23 in chunks of 512 (2,048 rows: 1.06
# against 1.28; 4,096: 1.08-1.15 against 1.13-1.20): oneDNN's bf16 products of ~1K rows
# of these shapes are slow. In fp32 chunks gained nothing (whole 0.23-0.26, chunks of
# 512 0.22-0.24).
MLP_ROWS = {torch.bfloat16: 512}


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` under the checkpoint's own names; gate and up run
    as one matrix product (:class:`RowFusion`), then ``silu(gate) * up`` in one pass on
    the CPU (``wavepp.model.cpu_kernel.silu_mul``), a bf16 wave in even chunks of at
    most :data:`MLP_ROWS` rows."""

    def __init__(self, d_model: int, d_ff: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(d_model, d_ff, bias=False))
        setattr(self, names[1], nn.Linear(d_model, d_ff, bias=False))
        setattr(self, names[2], nn.Linear(d_ff, d_model, bias=False))
        self.gate_up = RowFusion([getattr(self, names[0]), getattr(self, names[1])])

    def prepare(self) -> None:
        """Fuse gate and up once the checkpoint is loaded (``build_stage``)."""
        self.gate_up.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, d_model] -> [n, d_model]; gate_up: [rows, 2 d_ff] a chunk
        down, weight = getattr(self, self.names[2]), self.gate_up.weight()
        if x.dim() == 2 and cpu_kernel.fused_fits(x, weight):
            n = x.shape[0]
            chunks = -(-n // MLP_ROWS.get(x.dtype, n)) if n else 1
            if chunks == 1:
                return self._fused(x, weight, down)
            out = x.new_empty(n, down.out_features)
            step = -(-n // chunks)
            for a in range(0, n, step):
                out[a : a + step] = self._fused(x[a : a + step], weight, down)
            return out
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return down(F.silu(gate) * up)

    @staticmethod
    def _fused(x: torch.Tensor, weight: torch.Tensor, down: nn.Module) -> torch.Tensor:
        """The product into this thread's buffer, silu(gate) * up over its gate half."""
        gate_up = torch.mm(x, weight.t(), out=_SCRATCH.take(x.shape[0], weight.shape[0], x))
        return down(cpu_kernel.silu_mul(gate_up, in_place=True))


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
