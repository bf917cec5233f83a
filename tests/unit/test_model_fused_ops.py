"""A layer's token-wise work as WavePP's fused CPU ops (``cpu_fused.cpp``) gives what its
PyTorch form gives: bf16 to the bit but for a rare last-bit flip (every rounding is
where PyTorch's kernels round), fp32 to a few units in the last place (sums and FMAs
reassociated), on strided rows, partial rotary and the offset norm. Linears fused into
one product (``RowFusion``) keep their checkpoint names, load through their views, and
fuse again after a dtype change. A Llama stage with the fused ops gives the logits and
KV rows of the same stage with them off (``WAVEPP_CPU_FUSED=0``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wavepp.exec.base import ChunkWork
from wavepp.exec.torch_exec import TorchExecutor
from wavepp.model import BUILTIN, build_stage, common, cpu_kernel, random_weights
from wavepp.model.common import RMSNorm, RowFusion, SwiGLU, apply_rope, rms_norm, rope_tables

needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"kernel unavailable: {cpu_kernel.unavailable()}"
)
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal but for at most 1 in 1,000 elements one bf16 step apart; fp32: within
    a few units in the last place."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.bfloat16:
        differ = got != want
        assert differ.float().mean().item() <= 1e-3
        step = want.float().abs().clamp_min(1e-30) * 2.0**-7
        assert bool(((got.float() - want.float()).abs() <= step)[differ].all())
    else:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)


def _rows(dtype, rows: int, width: int, wider: int = 0, scale: float = 3.0) -> torch.Tensor:
    """[rows, width] as a view of a wider tensor (its rows strided) when wider > 0."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    base = (scale * torch.randn(rows, width + wider, generator=gen)).to(dtype)
    return base[:, :width]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width, wider", [(896, 0), (64, 40), (37, 0)])
def test_rms_norm_matches_its_pytorch_form(dtype, width, wider):
    x = _rows(dtype, 257, width, wider)
    weight = (1.0 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert_matches(cpu_kernel.rms_norm(x, weight, 1e-5, False), rms_norm(x, weight, 1e-5))
    x32 = x.float()
    offset = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
              * (1.0 + weight.float())).to(dtype)  # fmt: skip
    assert_matches(cpu_kernel.rms_norm(x, weight, 1e-5, True), offset)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 64), (40, 40), (64, 0)])
def test_rope_in_place_matches_apply_rope(dtype, head_dim, rotary_dim):
    tokens, heads = 131, 3
    q = _rows(dtype, tokens, heads * head_dim, wider=2 * head_dim).view(tokens, heads, head_dim)
    tables = rope_tables(torch.arange(tokens) + 4000, rotary_dim, 10_000.0, dtype)
    want = apply_rope(q.clone(), tables)
    got = cpu_kernel.rope_(q, *tables)
    assert got is q  # in place
    assert_matches(got, want)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width, wider", [(4864, 0), (40, 24)])
def test_silu_mul_matches_its_pytorch_form(dtype, width, wider):
    gate_up = _rows(dtype, 65, 2 * width, wider, scale=4.0)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert_matches(cpu_kernel.silu_mul(gate_up), want)
    got = cpu_kernel.silu_mul(gate_up, in_place=True)
    assert got.data_ptr() == gate_up.data_ptr()  # over the gate half
    assert_matches(got, want)


@needs_kernel
def test_fused_ops_refuse_what_they_cannot_serve():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernel.rms_norm(x, torch.ones(7), 1e-5, False)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.wavepp.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="2 f"):
        torch.ops.wavepp.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="w even"):
        torch.ops.wavepp.rope_(torch.zeros(4, 2, 8), torch.zeros(4, 3), torch.zeros(4, 3))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_with_the_fused_ops_match_them_off(dtype, monkeypatch):
    monkeypatch.setitem(common.MLP_ROWS, dtype, 128)  # 300 rows: three chunks of 100
    gen = torch.Generator().manual_seed(5)
    mlp, norm = SwiGLU(96, 160).to(dtype), RMSNorm(96, 1e-6, offset=True).to(dtype)
    with torch.no_grad():
        for p in (*mlp.parameters(), *norm.parameters()):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    x = torch.randn(300, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        fused = (mlp(x), norm(x), mlp(x[:7]))  # a smaller wave, one chunk, reuses the buffer
        monkeypatch.setenv("WAVEPP_CPU_FUSED", "0")
        plain = (mlp(x), norm(x), mlp(x[:7]))
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-6)  # fmt: skip


def test_row_fusion_keeps_names_loads_through_views_and_refuses_stale_weights():
    linears = [nn.Linear(8, n, bias=False) for n in (4, 2, 2)]
    holder = nn.ModuleList(linears)
    names = list(holder.state_dict())
    fusion = RowFusion(linears)
    fusion.fuse()
    weight = fusion.weight()
    assert weight.shape == (8, 8) and list(holder.state_dict()) == names
    assert all(m.weight.data_ptr() == weight[a:].data_ptr()
               for m, a in zip(linears, (0, 4, 6), strict=True))  # fmt: skip
    state = holder.state_dict().items()
    fresh = {k: torch.full(v.shape, float(i)) for i, (k, v) in enumerate(state)}
    holder.load_state_dict(fresh)  # written through the views
    assert fusion.weight() is weight
    assert weight[:, 0].tolist() == [0.0] * 4 + [1.0] * 2 + [2.0] * 2
    holder.to(torch.bfloat16)  # the weights replaced: fused again from them
    again = fusion.weight()
    assert again.dtype == torch.bfloat16 and again[:, 0].tolist() == weight[:, 0].tolist()
    assert linears[2].weight.data_ptr() == again[6:].data_ptr()


def test_a_swiglu_built_without_prepare_fuses_on_first_use():
    mlp = SwiGLU(16, 24)
    x = torch.randn(5, 16)
    want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want)


def _chunks(tokens: np.ndarray, table: list[int], bs: int) -> list[list[ChunkWork]]:
    n = len(tokens)
    return [[ChunkWork("a", s, min(n, s + 48), n, tuple(table[: -(-min(n, s + 48) // bs)]), (),
                       False, tokens=tokens[s : min(n, s + 48)])]
            for s in range(0, n, 48)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_llama_stage_with_the_fused_ops_matches_it_with_them_off(dtype, monkeypatch):
    cfg = BUILTIN["tiny-llama"]
    weights = random_weights(cfg, 0)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 100)
    table = list(range(7))
    runs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("WAVEPP_CPU_FUSED", fused)
        stage = build_stage(cfg, range(cfg.num_layers), True, True, weights, dtype=dtype)
        ex = TorchExecutor(stage, 8, 16, full_last_layer=True)
        for wave in _chunks(tokens, table, 16):
            ex.forward(wave, None)
        runs.append((ex.last_logits["a"], ex.pools[cfg.num_layers - 1]["k"][:100].clone()))
    (logits, keys), (plain_logits, plain_keys) = runs
    tol = {"rtol": 3e-2, "atol": 3e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(logits, plain_logits, **tol)
    torch.testing.assert_close(keys.float(), plain_keys.float(), **tol)
    assert int(logits.argmax()) == int(plain_logits.argmax())
