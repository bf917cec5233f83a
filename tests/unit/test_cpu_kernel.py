"""WavePP's CPU attention kernel equals the copying reference on every shape of wave the
runtime makes, and where it cannot serve, the PyTorch path does, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_attention import Chunk, copying_reference
from wavepp.exec import cpu_kernel
from wavepp.exec.attention import PagedBatch, paged_attention

needs_kernel = pytest.mark.skipif(
    cpu_kernel.library() is None, reason=f"kernel unavailable: {cpu_kernel.unavailable()}"
)


def random_pools(rows, kv_heads, d, dv, seed, latent=False):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(rows, kv_heads, d, generator=g)
    v_pool = k_pool[..., :dv] if latent else torch.randn(rows, kv_heads, dv, generator=g)
    return k_pool, v_pool, g


@st.composite
def waves(draw):
    """A wave over a pool whose slots are handed out in a shuffled order: cold chunks,
    chunks after a cached prefix, one-token chunks, two chunks of one request."""
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 8]))
    d = draw(st.sampled_from([16, 48, 64, 128]))
    dv = draw(st.sampled_from([16, 32, d])) if d >= 32 else 16
    spans = draw(st.lists(st.tuples(st.integers(0, 700), st.integers(1, 300)), min_size=1,
                          max_size=4))  # fmt: skip
    capacity = sum(-(-(s + n) // block_size) for s, n in spans)
    order = draw(st.permutations(range(capacity)))
    chunks, at = [], 0
    for start, n in spans:
        blocks = -(-(start + n) // block_size)
        chunks.append(Chunk(start, start + n, tuple(order[at : at + blocks])))
        at += blocks
    if draw(st.booleans()):  # the next chunk of the first request, in the same wave
        first = chunks[0]
        more = draw(st.integers(1, 200))
        blocks = -(-(first.end + more) // block_size)
        added = blocks - len(first.block_table)
        table = first.block_table + tuple(range(capacity, capacity + added))
        chunks[0] = Chunk(first.start, first.end, table)
        chunks.append(Chunk(first.end, first.end + more, table))
        capacity += blocks - len(first.block_table)
    return block_size, kv_heads, kv_heads * group, d, dv, chunks, capacity


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(waves(), st.integers(0, 2**16))
def test_kernel_equals_the_copying_reference(wave, seed):
    block_size, kv_heads, heads, d, dv, chunks, capacity = wave
    k_pool, v_pool, g = random_pools(capacity * block_size, kv_heads, d, dv, seed)
    batch = PagedBatch.build(chunks, block_size)
    q = torch.randn(batch.num_tokens, heads, d, generator=g)
    assert cpu_kernel.fits(q, k_pool, v_pool)
    got = paged_attention(q, k_pool, v_pool, batch, d**-0.5)
    want = copying_reference(q, k_pool, v_pool, chunks, block_size, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_latent_values_and_large_scores():
    # MLA's absorbed form (values a leading slice of each key entry, one KV head), and
    # scores far from 0: the online softmax rescales without overflow or underflow.
    chunks = [Chunk(300, 400, tuple(range(25))), Chunk(0, 33, (30, 31, 32))]
    k_pool, v_pool, g = random_pools(40 * 16, 1, 96, 64, 3, latent=True)
    batch = PagedBatch.build(chunks, 16)
    q = 30 * torch.randn(batch.num_tokens, 8, 96, generator=g)
    got = paged_attention(q, k_pool, v_pool, batch, 96**-0.5)
    want = copying_reference(q, k_pool, v_pool, chunks, 16, 96**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_what_the_kernel_does_not_serve_goes_to_pytorch(monkeypatch):
    k_pool, v_pool, g = random_pools(64, 2, 16, 8, 0)
    q = torch.randn(5, 4, 16, generator=g)
    assert not cpu_kernel.fits(q, k_pool, v_pool)  # values of 8 columns
    assert not cpu_kernel.fits(q.bfloat16(), k_pool.bfloat16(), k_pool.bfloat16())
    monkeypatch.setenv("WAVEPP_CPU_KERNEL", "0")
    assert not cpu_kernel.fits(q, k_pool, k_pool)
    assert cpu_kernel.describe(torch.device("cpu"), torch.float32).endswith("(WAVEPP_CPU_KERNEL=0)")
    # and the answer is the same either way
    chunks = [Chunk(10, 15, (2, 3))]
    batch = PagedBatch.build(chunks, 8)
    monkeypatch.setenv("WAVEPP_CPU_KERNEL", "1")
    fast = paged_attention(q, k_pool, k_pool, batch, 0.25)
    monkeypatch.setenv("WAVEPP_CPU_KERNEL", "0")
    slow = paged_attention(q, k_pool, k_pool, PagedBatch.build(chunks, 8), 0.25)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-4)


def test_a_failed_build_is_reported_and_pytorch_serves(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernel, "_LOADED", [])
    monkeypatch.setattr(cpu_kernel, "_REASON", [])
    monkeypatch.setenv("WAVEPP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert cpu_kernel.library() is None
    assert cpu_kernel.unavailable().startswith("false failed")
    assert "CPU attention kernel unavailable" in caplog.text
    assert "unavailable: false failed" in cpu_kernel.describe(torch.device("cpu"), torch.float32)
    k_pool, v_pool, g = random_pools(64, 1, 32, 32, 1)
    chunks = [Chunk(0, 20, (0, 1))]
    q = torch.randn(20, 2, 32, generator=g)
    got = paged_attention(q, k_pool, v_pool, PagedBatch.build(chunks, 16), 0.2)
    torch.testing.assert_close(got, copying_reference(q, k_pool, v_pool, chunks, 16, 0.2),
                               atol=2e-5, rtol=1e-4)  # fmt: skip
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves nothing behind"


@needs_kernel
def test_the_build_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernel, "_LOADED", [])
    monkeypatch.setenv("WAVEPP_CACHE", str(tmp_path))
    assert cpu_kernel.library() is not None
    built = list(tmp_path.rglob("cpu_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernel, "_LOADED", [])
    assert cpu_kernel.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@needs_kernel
def test_a_slot_outside_the_pool_is_refused_before_the_kernel_reads_it():
    k_pool, v_pool, g = random_pools(4 * 16, 1, 16, 16, 0)
    q = torch.randn(3, 2, 16, generator=g)
    batch = PagedBatch.build([Chunk(0, 3, (4,))], 16)  # the pool holds slots 0..3
    with pytest.raises(ValueError, match="outside the pool of 4 slots"):
        paged_attention(q, k_pool, v_pool, batch, 0.25)


def test_the_build_names_the_compiler_error():
    assert (
        cpu_kernel._first_error("In file included from x.c:1:\nx.c:3:2: error: #error no\n")
        == "x.c:3:2: error: #error no"
    )
    assert cpu_kernel._first_error("") == "no output"


def test_pools_are_zeroed_and_ask_for_huge_pages():
    from wavepp.exec.model import BUILTIN, build_stage, random_weights
    from wavepp.exec.torch_exec import TorchExecutor, huge_pages

    cfg = BUILTIN["tiny-llama"]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    ex = TorchExecutor(stage, capacity=512, block_size=16)
    assert all(int(t.count_nonzero()) == 0 for pool in ex.pools.values() for t in pool.values())
    if Path("/sys/kernel/mm/transparent_hugepage").is_dir():  # Linux with THP built in
        assert huge_pages(torch.empty(8 << 20, dtype=torch.uint8)) is True
    assert huge_pages(torch.empty(16, dtype=torch.uint8)) is False  # no whole 2 MiB page
