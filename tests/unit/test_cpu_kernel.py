"""WavePP's CPU attention kernel equals the copying reference on every shape of wave the
runtime makes, in fp32 and (within stated tolerances of a float64 reference) in bf16 by
each path this machine has, and where it cannot serve, the PyTorch path does, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_attention import Chunk, copying_reference
from wavepp.model import cpu_kernel
from wavepp.model.attention import PagedBatch, paged_attention

needs_kernel = pytest.mark.skipif(
    cpu_kernel.library() is None, reason=f"kernel unavailable: {cpu_kernel.unavailable()}"
)


def random_pools(rows, kv_heads, d, dv, seed, latent=False):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(rows, kv_heads, d, generator=g)
    v_pool = k_pool[..., :dv] if latent else torch.randn(rows, kv_heads, dv, generator=g)
    return k_pool, v_pool, g


@st.composite
def waves(draw, dims=(16, 48, 64, 128)):
    """A wave over a pool whose slots are handed out in a shuffled order: cold chunks,
    chunks after a cached prefix, one-token chunks, two chunks of one request."""
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3, 8]))
    d = draw(st.sampled_from(dims))
    dv = draw(st.sampled_from([16, 32] + [d] * (d % 16 == 0))) if d >= 32 else 16
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
    assert not cpu_kernel.fits(q.half(), k_pool.half(), k_pool.half())  # fp16: PyTorch's
    assert not cpu_kernel.fits(q.bfloat16(), k_pool.bfloat16(), k_pool)  # mixed dtypes
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
    from wavepp.exec.torch_exec import TorchExecutor, huge_pages
    from wavepp.model import BUILTIN, build_stage, random_weights

    cfg = BUILTIN["tiny-llama"]
    stage = build_stage(cfg, range(cfg.num_layers), True, True, random_weights(cfg, 0))
    ex = TorchExecutor(stage, capacity=512, block_size=16)
    assert all(int(t.count_nonzero()) == 0 for pool in ex.pools.values() for t in pool.values())
    if Path("/sys/kernel/mm/transparent_hugepage").is_dir():  # Linux with THP built in
        assert huge_pages(torch.empty(8 << 20, dtype=torch.uint8)) is True
    assert huge_pages(torch.empty(16, dtype=torch.uint8)) is False  # no whole 2 MiB page


# -- bf16: every path this machine has, against float64 ---------------------------------

PATHS = [p for p in cpu_kernel.BF16_PATHS if cpu_kernel._has(p)]
# Elementwise |kernel - float64| <= ATOL * max|V| + RTOL * |float64|, and the mean error
# at most MEAN of the mean bound. convert rounds once, at the output (half a bf16 step,
# 2^-9 of the value); amx and dot also round the weights P to bf16 (each by at most
# 2^-9 of itself, the weights summing to 1), which moves an output by at most 2^-9 of
# the largest value it averages.
TOLERANCES = {"convert": (2**-12, 2**-8, 0.5), "dot": (2**-8, 2**-8, 0.25),
              "amx": (2**-8, 2**-8, 0.25)}  # fmt: skip


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
    meta = cpu_kernel.wave_metadata(batch.starts, batch.spans, batch.tables)
    return cpu_kernel.paged_attention(q, k_pool, v_pool, *meta, batch.block_size, scale,
                                      path=path)  # fmt: skip


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(waves(dims=(16, 33, 64, 80, 128)), st.integers(0, 2**16), st.booleans())
def test_bf16_paths_against_float64(wave, seed, latent):
    # GQA and MLA's latent slice, odd head sizes, odd lengths, prefixes and chunks,
    # shuffled block tables: every path within its tolerance of the float64 answer
    block_size, kv_heads, heads, d, dv, chunks, capacity = wave
    latent = latent and dv <= d
    k_pool, v_pool, g = random_pools(capacity * block_size, kv_heads, d, dv, seed, latent)
    k_pool = k_pool.bfloat16()
    v_pool = k_pool[..., :dv] if latent else v_pool.bfloat16()
    batch = PagedBatch.build(chunks, block_size)
    q = (2 * torch.randn(batch.num_tokens, heads, d, generator=g)).bfloat16()
    assert cpu_kernel.fits(q, k_pool, v_pool)
    want = float64_reference(q, k_pool, v_pool, chunks, block_size, d**-0.5)
    for path in PATHS:
        got = kernel_bf16(q, k_pool, v_pool, batch, d**-0.5, path)
        assert_bf16_close(got, want, path, v_pool)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_bf16_latent_values_and_large_scores(path):
    chunks = [Chunk(300, 403, tuple(range(26))), Chunk(0, 33, (30, 31, 32))]
    k_pool, _, g = random_pools(40 * 16, 1, 96, 64, 3)
    k_pool = k_pool.bfloat16()
    batch = PagedBatch.build(chunks, 16)
    q = (30 * torch.randn(batch.num_tokens, 8, 96, generator=g)).bfloat16()
    got = kernel_bf16(q, k_pool, k_pool[..., :64], batch, 96**-0.5, path)
    assert torch.isfinite(got).all()
    want = float64_reference(q, k_pool, k_pool[..., :64], chunks, 16, 96**-0.5)
    assert_bf16_close(got, want, path, k_pool[..., :64])


@needs_kernel
def test_the_bf16_path_follows_the_environment(monkeypatch):
    # WAVEPP_CPU_BF16 forces a path (convert exists wherever the kernel does), the
    # executor's log line names it, and the wave's answer goes through it
    chunks = [Chunk(20, 45, (5, 1, 3)), Chunk(0, 7, (0,))]
    k_pool, v_pool, g = random_pools(8 * 16, 2, 64, 64, 9)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    q = torch.randn(32, 4, 64, generator=g).bfloat16()
    want = float64_reference(q, k_pool, v_pool, chunks, 16, 0.125)
    for path in PATHS:
        monkeypatch.setenv("WAVEPP_CPU_BF16", path)
        assert cpu_kernel.bf16_path() == path
        label = cpu_kernel.describe(torch.device("cpu"), torch.bfloat16)
        assert label.startswith("WavePP's CPU kernel (AVX-512, bf16: ")
        assert label.endswith(cpu_kernel._BF16_LABELS[path] + ")")
        got = paged_attention(q, k_pool, v_pool, PagedBatch.build(chunks, 16), 0.125)
        assert_bf16_close(got, want, path, v_pool)
    monkeypatch.setenv("WAVEPP_CPU_BF16", "auto")
    assert cpu_kernel.bf16_path() == PATHS[0]
    monkeypatch.setenv("WAVEPP_CPU_BF16", "fast")
    with pytest.raises(ValueError, match="choose auto, amx, dot, convert"):
        cpu_kernel.bf16_path()


@needs_kernel
def test_bf16_paths_agree_with_each_other_and_beat_pytorchs_bf16():
    # the rounded-P paths (amx, dot) differ only by summation order; all are closer to
    # float64 on average than PyTorch's own bf16 attention
    chunks = [Chunk(0, 130, tuple(range(9))), Chunk(512, 700, tuple(range(9, 53)))]
    k_pool, v_pool, g = random_pools(60 * 16, 2, 64, 64, 4)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    batch = PagedBatch.build(chunks, 16)
    q = (2 * torch.randn(batch.num_tokens, 8, 64, generator=g)).bfloat16()
    want = float64_reference(q, k_pool, v_pool, chunks, 16, 0.125)
    got = {path: kernel_bf16(q, k_pool, v_pool, batch, 0.125, path) for path in PATHS}
    if "amx" in got and "dot" in got:
        assert (got["amx"] != got["dot"]).float().mean() < 0.01
    with cpu_kernel.off():
        theirs = paged_attention(q, k_pool, v_pool, batch, 0.125)
    for out in got.values():
        assert (out.double() - want).abs().mean() < (theirs.double() - want).abs().mean()


@needs_kernel
def test_a_build_without_bf16_instructions_converts(monkeypatch, tmp_path):
    # the source compiled as for an AVX-512 CPU without AMX or AVX-512 BF16: only the
    # convert path exists, whatever is asked, and it is within its tolerance
    monkeypatch.setattr(cpu_kernel, "_LOADED", [])
    monkeypatch.setattr(cpu_kernel, "_AMX", [])
    monkeypatch.setattr(cpu_kernel, "FLAGS",
                        [*cpu_kernel.FLAGS, "-mno-amx-tile", "-mno-amx-bf16",
                         "-mno-avx512bf16"])  # fmt: skip
    monkeypatch.setenv("WAVEPP_CACHE", str(tmp_path))
    assert cpu_kernel.library().wavepp_bf16_paths() == 0
    for wanted in ("auto", "amx", "dot", "convert"):
        monkeypatch.setenv("WAVEPP_CPU_BF16", wanted)
        assert cpu_kernel.bf16_path() == "convert"
    assert cpu_kernel.describe(torch.device("cpu"), torch.bfloat16).endswith("converted to fp32)")
    chunks = [Chunk(40, 77, (2, 0, 4, 3, 1)), Chunk(0, 9, (5,))]
    k_pool, v_pool, g = random_pools(6 * 16, 2, 64, 32, 11)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    q = torch.randn(46, 6, 64, generator=g).bfloat16()
    batch = PagedBatch.build(chunks, 16)
    for path in cpu_kernel.BF16_PATHS:  # asked for directly, too
        got = kernel_bf16(q, k_pool, v_pool, batch, 0.125, path)
        want = float64_reference(q, k_pool, v_pool, chunks, 16, 0.125)
        assert_bf16_close(got, want, "convert", v_pool)
