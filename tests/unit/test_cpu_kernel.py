"""WavePP's CPU attention kernel equals the copying reference on every shape of wave the
runtime makes, in fp32 and (within stated tolerances of a float64 reference) in bf16 by
each path this machine has; the PyTorch path that serves where it cannot (forced here
by ``cpu_kernel.off()``) meets the same checks, so they mean something on a CPU without
AVX-512. Its build is remembered when it fails, killed when it hangs, rebuilt once when
it does not load, and refused from a cache others could write."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.attention import (
    Chunk,
    assert_bf16_close,
    copying_reference,
    float64_reference,
    kernel_bf16,
    random_pools,
)
from wavepp.model import cpu_kernel, cpu_kernel_build
from wavepp.model.attention import PagedBatch, paged_attention

needs_kernel = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"kernel unavailable: {cpu_kernel.unavailable()}"
)
# Where a wave is served: WavePP's kernel (where this machine builds it) or PyTorch's path
BACKENDS = [pytest.param("kernel", marks=needs_kernel), "pytorch"]
ROOT = Path(__file__).resolve().parents[2]


def served_by(backend: str):
    return cpu_kernel.off() if backend == "pytorch" else contextlib.nullcontext()


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


def check_wave(backend, wave, seed):
    block_size, kv_heads, heads, d, dv, chunks, capacity = wave
    k_pool, v_pool, g = random_pools(capacity * block_size, kv_heads, d, dv, seed)
    batch = PagedBatch.build(chunks, block_size)
    q = torch.randn(batch.num_tokens, heads, d, generator=g)
    with served_by(backend):
        assert cpu_kernel.fits(q, k_pool, v_pool) == (backend == "kernel")
        got = paged_attention(q, k_pool, v_pool, batch, d**-0.5)
    want = copying_reference(q, k_pool, v_pool, chunks, block_size, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(waves(), st.integers(0, 2**16))
def test_kernel_equals_the_copying_reference(wave, seed):
    check_wave("kernel", wave, seed)


@settings(max_examples=15, deadline=None)  # slower, on fragmented tables: fewer waves
@given(waves(), st.integers(0, 2**16))
def test_pytorchs_path_equals_the_copying_reference(wave, seed):
    check_wave("pytorch", wave, seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_latent_values_and_large_scores(backend):
    # MLA's absorbed form (values a leading slice of each key entry, one KV head), and
    # scores far from 0: the online softmax rescales without overflow or underflow.
    chunks = [Chunk(300, 400, tuple(range(25))), Chunk(0, 33, (30, 31, 32))]
    k_pool, v_pool, g = random_pools(40 * 16, 1, 96, 64, 3, latent=True)
    batch = PagedBatch.build(chunks, 16)
    q = 30 * torch.randn(batch.num_tokens, 8, 96, generator=g)
    with served_by(backend):
        got = paged_attention(q, k_pool, v_pool, batch, 96**-0.5)
    want = copying_reference(q, k_pool, v_pool, chunks, 16, 96**-0.5)
    assert torch.isfinite(got).all()
    # PyTorch's path (the math attention, Dv != D) rounds scores this large differently
    atol, rtol = (2e-5, 1e-4) if backend == "kernel" else (2e-4, 4e-3)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


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


def fake_compiler(tmp_path: Path, compile_step: str) -> Path:
    """A C++ compiler that answers ``--version`` and runs ``compile_step`` (shell) for a
    compile, after noting its pid in ``<itself>.calls``."""
    path = tmp_path / "fake-c++"
    path.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in
          *" -c "*) echo $$ >> "$0.calls"; {compile_step};;
          *) echo "fake c++ 1.0";;
        esac
        """))  # fmt: skip
    path.chmod(0o700)
    return path


def compiles(compiler: Path) -> list[int]:
    calls = Path(f"{compiler}.calls")
    return [int(pid) for pid in calls.read_text().split()] if calls.exists() else []


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a process loads one build of the kernel)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_a_failed_build_is_remembered(tmp_path):
    compiler = fake_compiler(tmp_path, 'echo "x.cpp:3:2: error: no AVX-512 here" >&2; exit 1')
    build = cpu_kernel.KernelBuild(tmp_path / "cache", str(compiler))
    with pytest.raises(cpu_kernel.KernelUnavailable, match=r"x\.cpp:3:2: error: no AVX-512 here"):
        build.library()
    tried = len(compiles(compiler))
    assert 1 <= tried <= len(cpu_kernel.SOURCES)  # at most one compile per source
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"
    again = cpu_kernel.KernelBuild(tmp_path / "cache", str(compiler))  # the next start
    with pytest.raises(cpu_kernel.KernelUnavailable, match=r"no AVX-512 here.*delete it to try"):
        again.library()
    assert len(compiles(compiler)) == tried, "a remembered failure is not built again"


def test_a_hung_compiler_is_killed_and_remembered(tmp_path):
    compiler = fake_compiler(tmp_path, "exec sleep 600")
    build = cpu_kernel.KernelBuild(tmp_path / "cache", str(compiler), timeout_s=3)
    with pytest.raises(cpu_kernel.KernelUnavailable, match="longer than 3 s"):
        build.library()
    for pid in compiles(compiler):  # the compiler, killed with its build
        stat = Path(f"/proc/{pid}/stat")
        for _ in range(100):
            if not stat.exists() or stat.read_text().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the hung compiler {pid} still runs")
    with pytest.raises(cpu_kernel.KernelUnavailable, match="longer than 3 s"):
        cpu_kernel.KernelBuild(tmp_path / "cache", str(compiler)).library()


def test_a_cache_others_could_write_or_own_is_refused(tmp_path, monkeypatch):
    compiler = fake_compiler(tmp_path, "exit 1")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    build = cpu_kernel.KernelBuild(cache, str(compiler))
    with pytest.raises(cpu_kernel.KernelUnavailable, match="writable by its group or others"):
        build.library()
    cache.chmod(0o700)
    directory = build.directory()
    library = directory / f"{cpu_kernel.NAME}.so"
    library.write_bytes(b"planted")
    library.chmod(0o722)
    with pytest.raises(cpu_kernel.KernelUnavailable, match=re.escape(f"{library} is writable")):
        build.library()
    library.chmod(0o700)
    assert build.library() == library
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.raises(cpu_kernel.KernelUnavailable, match=re.escape(f"{cache} belongs to uid")):
        build.library()
    assert compiles(compiler) == [], "nothing was built in a refused cache"


@pytest.mark.slow  # fresh interpreters, and a build
def test_a_rank_whose_build_fails_logs_one_line_and_pytorch_serves(tmp_path):
    compiler = fake_compiler(tmp_path, 'echo "x.cpp:1:1: error: broken" >&2; exit 1')
    code = """
        import logging
        import torch
        from tests.helpers.attention import Chunk, copying_reference
        from wavepp.model import cpu_kernel
        from wavepp.model.attention import PagedBatch, paged_attention

        logging.basicConfig(format="%(name)s: %(message)s")
        print(cpu_kernel.describe(torch.device("cpu"), torch.float32))
        g = torch.Generator().manual_seed(1)
        k_pool, v_pool = torch.randn(64, 1, 32, generator=g), torch.randn(64, 1, 32, generator=g)
        q = torch.randn(20, 2, 32, generator=g)
        chunks = [Chunk(0, 20, (0, 1))]
        got = paged_attention(q, k_pool, v_pool, PagedBatch.build(chunks, 16), 0.2)
        want = copying_reference(q, k_pool, v_pool, chunks, 16, 0.2)
        print(float((got - want).abs().max()))
    """
    env = {"WAVEPP_CACHE": str(tmp_path / "cache"), "CXX": str(compiler)}
    tried = None
    for _ in range(2):  # the second start remembers the first one's failure
        done = run_python(code, env)
        assert done.returncode == 0, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if "kernel unavailable" in ln]
        assert len(lines) == 1 and "x.cpp:1:1: error: broken" in lines[0], done.stderr
        label, diff = done.stdout.splitlines()
        assert label.startswith("PyTorch's (WavePP's CPU kernel unavailable: x.cpp:1:1")
        assert float(diff) < 1e-5
        tried = tried or len(compiles(compiler))  # one build: a compile per source at most
        assert 1 <= len(compiles(compiler)) == tried <= len(cpu_kernel.SOURCES)


@pytest.mark.slow  # a fresh interpreter
def test_a_library_without_the_op_is_refused_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("WAVEPP_CACHE", str(tmp_path / "cache"))
    directory = cpu_kernel.KernelBuild.from_env().directory()
    empty = tmp_path / "empty.c"
    empty.write_text("int wavepp_nothing(void) { return 0; }\n")
    library = directory / f"{cpu_kernel.NAME}.so"
    built = subprocess.run(["cc", "-shared", "-fPIC", str(empty), "-o", str(library)],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode:
        pytest.skip(f"no C compiler to make a library without the op: {built.stderr}")
    library.chmod(0o700)
    done = run_python("""
        import logging
        from wavepp.model import cpu_kernel
        logging.basicConfig(format="%(name)s: %(message)s")
        print(cpu_kernel.available())
    """, {"WAVEPP_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "kernel unavailable" in ln]
    assert len(lines) == 1 and "does not register the op" in lines[0], done.stderr
    assert (directory / "FAILED").exists() and not library.exists()


@pytest.mark.slow  # fresh interpreters, and a build
@needs_kernel
def test_a_build_is_found_again_and_one_that_does_not_load_is_rebuilt_once(tmp_path, monkeypatch):
    # this process's build, copied to a fresh cache, is found there, not rebuilt; then
    # spoilt, the next process rebuilds it once and serves from the new one
    loaded = cpu_kernel.KernelBuild.from_env().library()
    monkeypatch.setenv("WAVEPP_CACHE", str(tmp_path / "cache"))
    build = cpu_kernel.KernelBuild.from_env()
    mine = build.directory()
    mine.rmdir()
    shutil.copytree(loaded.parent, mine)
    library = mine / f"{cpu_kernel.NAME}.so"
    stamp = library.stat().st_mtime_ns
    assert build.library() == library
    assert library.stat().st_mtime_ns == stamp  # found, not rebuilt
    library.write_bytes(b"not a shared library")
    done = run_python("""
        import logging
        from wavepp.model import cpu_kernel
        logging.basicConfig(format="%(name)s: %(message)s")
        print(cpu_kernel.available())
    """, {"WAVEPP_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"], done.stderr
    assert done.stderr.count("does not load") == 1 and "rebuilding it once" in done.stderr
    assert library.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_outside_the_pool_is_refused_before_it_is_read(backend):
    k_pool, v_pool, g = random_pools(4 * 16, 1, 16, 16, 0)
    q = torch.randn(3, 2, 16, generator=g)
    batch = PagedBatch.build([Chunk(0, 3, (4,))], 16)  # the pool holds slots 0..3
    with served_by(backend), pytest.raises((ValueError, IndexError)):
        paged_attention(q, k_pool, v_pool, batch, 0.25)
    if backend == "kernel":  # the op checks its arguments: a ValueError that says so
        with pytest.raises(ValueError, match="outside the pool of 4 slots"):
            paged_attention(q, k_pool, v_pool, batch, 0.25)
        meta = cpu_kernel.wave_metadata([0], [(0, 3)], [(0,)])
        with pytest.raises(RuntimeError, match="reads queries outside q"):
            cpu_kernel.paged_attention(q[:2], k_pool, v_pool, *meta, 16, 0.25)
        with pytest.raises(RuntimeError, match="share one dtype"):
            cpu_kernel.paged_attention(q.bfloat16(), k_pool, v_pool, *meta, 16, 0.25)


def test_the_build_names_the_compiler_error():
    assert (
        cpu_kernel_build.first_error("In file included from x.c:1:\nx.c:3:2: error: #error no\n")
        == "x.c:3:2: error: #error no"
    )
    assert cpu_kernel_build.first_error("") == "no output"


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


@settings(max_examples=25, deadline=None)
@given(waves(dims=(16, 33, 64, 80, 128)), st.integers(0, 2**16), st.booleans())
def test_bf16_paths_against_float64(wave, seed, latent):
    # GQA and MLA's latent slice, odd head sizes, odd lengths, prefixes and chunks,
    # shuffled block tables: every path this machine has, and PyTorch's, within its
    # tolerance of the float64 answer
    block_size, kv_heads, heads, d, dv, chunks, capacity = wave
    latent = latent and dv <= d
    k_pool, v_pool, g = random_pools(capacity * block_size, kv_heads, d, dv, seed, latent)
    k_pool = k_pool.bfloat16()
    v_pool = k_pool[..., :dv] if latent else v_pool.bfloat16()
    batch = PagedBatch.build(chunks, block_size)
    q = (2 * torch.randn(batch.num_tokens, heads, d, generator=g)).bfloat16()
    assert cpu_kernel.fits(q, k_pool, v_pool) == cpu_kernel.available()
    want = float64_reference(q, k_pool, v_pool, chunks, block_size, d**-0.5)
    for path in [*PATHS, "pytorch"]:
        got = kernel_bf16(q, k_pool, v_pool, batch, d**-0.5, path)
        assert_bf16_close(got, want, path, v_pool)


@pytest.mark.parametrize("path", [*PATHS, "pytorch"])
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
    # float64 on average than PyTorch's own attention computed in bf16 (WavePP's portable
    # path upcasts to fp32 since it lost a tiny model's logits in bf16)
    chunks = [Chunk(0, 130, tuple(range(9))), Chunk(512, 700, tuple(range(9, 53)))]
    k_pool, v_pool, g = random_pools(60 * 16, 2, 64, 64, 4)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    batch = PagedBatch.build(chunks, 16)
    q = (2 * torch.randn(batch.num_tokens, 8, 64, generator=g)).bfloat16()
    want = float64_reference(q, k_pool, v_pool, chunks, 16, 0.125)
    got = {path: kernel_bf16(q, k_pool, v_pool, batch, 0.125, path) for path in PATHS}
    if "amx" in got and "dot" in got:
        assert (got["amx"] != got["dot"]).float().mean() < 0.01
    theirs = copying_reference(q, k_pool, v_pool, chunks, 16, 0.125, dtype=torch.bfloat16)
    for out in got.values():
        assert (out.double() - want).abs().mean() < (theirs.double() - want).abs().mean()


@pytest.mark.slow  # fresh interpreters, and a build
@needs_kernel
def test_a_build_without_bf16_instructions_converts(tmp_path):
    # the source compiled as for an AVX-512 CPU without AMX or AVX-512 BF16 (the compiler
    # told so after -march=native): only the convert path exists, whatever is asked, and
    # it is within its tolerance
    compiler = tmp_path / "c++-without-bf16"
    compiler.write_text('#!/bin/sh\nexec c++ "$@" -mno-amx-tile -mno-amx-bf16 -mno-avx512bf16\n')
    compiler.chmod(0o700)
    done = run_python("""
        import os
        import torch
        from tests.helpers.attention import (
            Chunk, assert_bf16_close, float64_reference, kernel_bf16, random_pools)
        from wavepp.model import cpu_kernel
        from wavepp.model.attention import PagedBatch

        assert cpu_kernel.available() and cpu_kernel._bf16_paths() == 0
        for wanted in ("auto", "amx", "dot", "convert"):
            os.environ["WAVEPP_CPU_BF16"] = wanted
            assert cpu_kernel.bf16_path() == "convert"
        label = cpu_kernel.describe(torch.device("cpu"), torch.bfloat16)
        assert label.endswith("converted to fp32)"), label
        chunks = [Chunk(40, 77, (2, 0, 4, 3, 1)), Chunk(0, 9, (5,))]
        k_pool, v_pool, g = random_pools(6 * 16, 2, 64, 32, 11)
        k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
        q = torch.randn(46, 6, 64, generator=g).bfloat16()
        batch = PagedBatch.build(chunks, 16)
        want = float64_reference(q, k_pool, v_pool, chunks, 16, 0.125)
        for path in cpu_kernel.BF16_PATHS:  # asked for directly, too
            got = kernel_bf16(q, k_pool, v_pool, batch, 0.125, path)
            assert_bf16_close(got, want, "convert", v_pool)
        print("checked")
    """, {"WAVEPP_CACHE": str(tmp_path / "cache"), "CXX": str(compiler)})  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["checked"], done.stderr
