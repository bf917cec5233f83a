"""References for paged attention: the copying path (gather the whole prefix, mask
densely) in any dtype, float64 with bf16 tolerances, and the CPU kernel's paths."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from wavepp.model import cpu_kernel
from wavepp.model.attention import paged_attention


@attrs.frozen
class Chunk:
    """A request's chunk of a wave: tokens ``start..end`` over its block table."""

    start: int
    end: int
    block_table: tuple[int, ...]


def copying_reference(q, k_pool, v_pool, chunks, block_size, scale, dtype=torch.float32):
    """The executor's attention before the block-table path, kept as the reference:
    per chunk, copy every row 0..end-1 out of the pool and mask [n, m] densely, computed
    in ``dtype`` (float64 inputs in float64)."""
    outs, at = [], 0
    for c in chunks:
        n = c.end - c.start
        table = torch.as_tensor(c.block_table, dtype=torch.long)
        every = torch.arange(c.end)
        rows = table[every // block_size] * block_size + every % block_size
        wide = torch.float64 if q.dtype == torch.float64 else dtype
        keys, values = k_pool[rows].to(wide), v_pool[rows].to(wide)  # [m, KV, D]
        positions = torch.arange(c.start, c.end)
        mask = torch.arange(c.end)[None, :] <= positions[:, None]  # [n, m]
        out = F.scaled_dot_product_attention(
            q[at : at + n].to(wide).transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(out[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def random_pools(rows, kv_heads, d, dv, seed, latent=False):
    """Key and value pools of ``rows`` rows (values a leading slice of the keys when
    ``latent``) and the generator that drew them, for drawing more."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(rows, kv_heads, d, generator=g)
    v_pool = k_pool[..., :dv] if latent else torch.randn(rows, kv_heads, dv, generator=g)
    return k_pool, v_pool, g


# Elementwise |kernel - float64| <= ATOL * max|V| + RTOL * |float64|, and the mean error
# at most MEAN of the mean bound. convert rounds once, at the output (half a bf16 step,
# 2^-9 of the value); amx and dot also round the weights P to bf16 (each by at most
# 2^-9 of itself, the weights summing to 1), which moves an output by at most 2^-9 of
# the largest value it averages. PyTorch's path (its flash attention per part, the
# parts rounded to bf16 and merged) is held to dot's bounds.
TOLERANCES = {"convert": (2**-12, 2**-8, 0.5), "dot": (2**-8, 2**-8, 0.25),
              "amx": (2**-8, 2**-8, 0.25), "pytorch": (2**-8, 2**-8, 0.25)}  # fmt: skip


def float64_reference(q, k_pool, v_pool, chunks, block_size, scale):
    return copying_reference(q.double(), k_pool.double(), v_pool.double(), chunks, block_size,
                             scale)  # fmt: skip


def assert_bf16_close(got, want, path, v_pool):
    atol, rtol, mean = TOLERANCES[path]
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    bound = atol * float(v_pool.abs().max()) + rtol * want.abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{path}: error {err.flatten()[worst]:.2e} at {want.flatten()[worst]:.3f}"
    )
    assert float(err.mean()) <= mean * float(bound.mean()), (
        f"{path}: mean error {float(err.mean()):.2e}, mean bound {float(bound.mean()):.2e}"
    )


def kernel_bf16(q, k_pool, v_pool, batch, scale, path):
    """The wave by the kernel's ``path``, or by the PyTorch path (``path="pytorch"``)."""
    if path == "pytorch":
        with cpu_kernel.off():
            return paged_attention(q, k_pool, v_pool, batch, scale)
    meta = cpu_kernel.wave_metadata(batch.starts, batch.spans, batch.tables)
    return cpu_kernel.paged_attention(q, k_pool, v_pool, *meta, batch.block_size, scale,
                                      path=path)  # fmt: skip
