"""Attention from the block table equals the old copying path (gather the whole prefix,
build a dense [n, m] mask) to fp32 rounding, for every shape of wave the runtime makes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.attention import Chunk, copying_reference
from wavepp.model import attention as attn
from wavepp.model.attention import PagedBatch, paged_attention, write_paged


def run_wave(chunks, block_size, capacity, heads, kv_heads, d, dv=None, dtype=torch.float32,
             seed=0, latent=False):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    rows = capacity * block_size
    k_pool = torch.randn(rows, kv_heads, d, generator=g).to(dtype)
    v_pool = (
        k_pool[..., :dv] if latent else torch.randn(rows, kv_heads, dv or d, generator=g).to(dtype)
    )
    total = sum(c.end - c.start for c in chunks)
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    new_k = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    batch = PagedBatch.build(chunks, block_size)
    write_paged(k_pool, batch, new_k)
    if not latent:
        write_paged(v_pool, batch, torch.randn(total, kv_heads, dv or d, generator=g).to(dtype))
    scale = d**-0.5
    got = paged_attention(q, k_pool, v_pool, batch, scale)
    want = copying_reference(q, k_pool, v_pool, chunks, block_size, scale)
    return got, want, batch


def test_a_wave_of_mixed_chunks_equals_the_copying_path():
    bs = 16
    chunks = [
        Chunk(0, 40, (3, 4, 5)),  # cold, no prefix
        Chunk(64, 100, (0, 1, 2, 7, 9, 10, 11)),  # cached prefix over two runs, mid-block end
        Chunk(37, 70, (12, 13, 14, 15, 16)),  # resumes mid-block (its own earlier chunk)
        Chunk(5, 6, (20,)),  # one token
    ]
    got, want, _ = run_wave(chunks, bs, capacity=32, heads=8, kv_heads=2, d=32)
    assert got.shape == (40 + 36 + 33 + 1, 8, 32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_two_chunks_of_one_request_in_one_wave():
    # The second chunk's prefix includes rows the first chunk writes in the same wave.
    table = tuple(range(8))
    chunks = [Chunk(0, 50, table[:4]), Chunk(50, 120, table)]
    got, want, _ = run_wave(chunks, 16, capacity=8, heads=4, kv_heads=4, d=16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_long_and_fragmented_prefixes_read_in_place_and_gathered(monkeypatch):
    monkeypatch.setattr(attn, "_GATHER_ROWS", 64)
    bs = 16
    contiguous = tuple(range(0, 40))  # 640 rows in one run: read in place
    scattered = tuple(range(40, 120, 2))  # 40 one-block runs: gathered in pieces
    chunks = [Chunk(600, 640, contiguous), Chunk(600, 640, scattered)]
    got, want, batch = run_wave(chunks, bs, capacity=128, heads=4, kv_heads=1, d=32)
    assert batch.prefix_pieces[0] == [(0, 600)]
    gathered = batch.prefix_pieces[1]
    assert all(isinstance(p, torch.Tensor) for p in gathered) and len(gathered) == 10
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_latent_values_are_a_leading_slice_of_the_keys():
    # MLA absorbed: MQA over a latent cache whose value is the entry's first dv dims.
    chunks = [Chunk(0, 20, (0, 1)), Chunk(32, 48, (2, 3, 4))]
    got, want, _ = run_wave(chunks, 16, capacity=8, heads=4, kv_heads=1, d=48, dv=32, latent=True)
    assert got.shape == (36, 4, 32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_separate_values_of_another_width():
    chunks = [Chunk(16, 30, (0, 1)), Chunk(0, 7, (5,))]
    got, want, _ = run_wave(chunks, 16, capacity=8, heads=2, kv_heads=2, d=16, dv=8)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bfloat16_pool_stays_close_to_fp32():
    chunks = [Chunk(48, 80, (4, 5, 6, 7, 8))]
    got, want, _ = run_wave(chunks, 16, capacity=16, heads=4, kv_heads=2, d=32,
                            dtype=torch.bfloat16)  # fmt: skip
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_merge_of_disjoint_key_sets_is_softmax_over_their_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    k2, v2 = torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    parts = [attn._attend(q, k, v, False, 0.3), attn._attend(q, k2, v2, False, 0.3)]
    whole = F.scaled_dot_product_attention(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2),
                                           scale=0.3)  # fmt: skip
    torch.testing.assert_close(attn._merge(parts), whole, atol=1e-5, rtol=1e-5)
    lse = (q @ k.transpose(-1, -2) * 0.3).logsumexp(-1)
    torch.testing.assert_close(parts[0][1], lse, atol=1e-5, rtol=1e-5)
    assert not math.isnan(float(parts[0][1].sum()))


def test_bad_shapes_are_refused_with_the_numbers():
    batch = PagedBatch.build([Chunk(0, 4, (0,))], 16)
    with pytest.raises(ValueError, match="3 queries for a wave of 4 tokens"):
        paged_attention(torch.zeros(3, 2, 8), torch.zeros(16, 1, 8), torch.zeros(16, 1, 8),
                        batch, 1.0)  # fmt: skip
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold tokens up to 20"):
        PagedBatch.build([Chunk(0, 20, (0,))], 16)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-hybrid"])
def test_executor_in_bfloat16_on_cpu(model):
    """Weights and KV pool in bf16, recurrent states and snapshots kept in fp32; a
    chunked, prefix-reusing forward stays close to the fp32 full forward."""
    import numpy as np

    from wavepp.exec.base import ChunkWork
    from wavepp.exec.torch_exec import TorchExecutor
    from wavepp.model import BUILTIN, build_stage, random_weights, reference_logits

    cfg = BUILTIN[model]
    weights = random_weights(cfg, 3)
    stage = build_stage(cfg, range(cfg.num_layers), True, True, weights, dtype=torch.bfloat16)
    ex = TorchExecutor(stage, capacity=8, block_size=16)
    assert all(t.dtype == torch.bfloat16 for pool in ex.pools.values() for t in pool.values())
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 100)
    table = tuple(range(7))
    first = ChunkWork("r", 0, 64, 100, table[:4], (4,), False, snapshot_slots=(0,),
                      tokens=tokens[:64])  # fmt: skip
    ex.forward([first], None)
    if "L" in cfg.pattern:
        for pool in ex.snapshot_pools.values():  # slot 0 took the snapshot
            assert all(t.dtype == torch.float32 and t[0].abs().sum() > 0 for t in pool.values())
    ex.live.clear()  # resume from the snapshot, as a new request sharing the prefix would
    rest = ChunkWork("r", 64, 100, 100, table, (), False, resume_slot=0 if "L" in cfg.pattern
                     else None, tokens=tokens[64:])  # fmt: skip
    _, results = ex.forward([rest], None)
    got = ex.last_logits["r"]
    want = reference_logits(cfg, weights, tokens)
    assert results["r"][0] == int(got.argmax())
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.08, f"bf16 logits differ from fp32 by {float(rel):.3f} of the range"
